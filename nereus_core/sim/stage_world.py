"""A stage-time world model that is not the cost model: what a PPO stage takes on real GPUs.

Boundary: pure arithmetic over a model's size, one step's response lengths and a GPU
(``Gpu``), with a handful of free constants (``WorldConstants``) fitted to real logs
by ``fit`` (benchmarks/validate_cost_model.py fits them to verl's Qwen2.5-0.5B GSM8K
PPO logs and checks them on the held-out gemma-2-2b log; ``FITTED`` is that fit) and, for 7-8B
models, by benchmarks/fit_world_7b.py on published 7B runs (``FITTED_7B``; ``constants_for``
picks by size).
It shares no formula with ``stage_cost``/``cost.terms``, so comparing the two can show
the cost model wrong. ``world.World`` uses it as the simulator's truth.

Generation: each sequence's response length is drawn from the step's
distribution (a Beta between 1 and the step's max with the step's mean, its spread set
so its p90 is the step's p90 where that is known; the longest sequence reaches the max only as
often as the Beta says);
each DP replica runs continuous batching under its KV budget (a finished sequence frees
its slot for a waiting one; paged KV, so a sequence holds the KV of its mean context);
every decode iteration costs a fixed overhead by the engine's mode (``decode_overhead_s``:
``decode_step_s`` eager, ``decode_step_graphs_s`` with CUDA graphs; scheduler, sampling, kernel
launches), two all-reduces per layer under TP (their latency per iteration, their bytes per
running sequence over the TP link), at most ``max_num_seqs`` sequences per engine, and the
larger of reading the weights / tp plus the active KV cache from HBM (decode is
memory-bound) and the iteration's FLOPs; the stage ends with the slowest replica, plus ``generate_fixed_s``
per step (engine wake-up, weight load into the engine, tokenisation). Summed over a
replica, the KV read and the FLOPs do not depend on the schedule, only the number of
iterations does (FCFS list scheduling onto the slots).
Infer and train passes: a fixed cost per call plus FLOPs (2 x params per token forward,
6 x train, plus attention 4 (12) x layers x hidden x seq; Narayanan et al. 2021)
at ``mfu`` of the peak on the slowest DP replica (the batch's tokens balanced over the replicas)
and its busiest pipeline stage (whole layers per stage, the head on the last), the pipeline
bubble (m + p - 1) / m (Narayanan et al., 2021), TP all-reduces over the link, and the Adam
step's memory traffic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class Gpu:
    """One accelerator's peak figures and its links."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    link_bytes_per_s: float = 380e9  # NVLink 4, ~380 GB/s measured one way (NVIDIA/nccl#1264)


# NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, 80 GB; NVLink 3 300 GB/s one
# way. The verl logs do not name their GPU; A100-80GB is assumed (verl's reference runs were on A100s).
A100_80GB = Gpu("a100-80gb", 312e12, 2.039e12, 80e9, 300e9)
# NVIDIA H100 whitepaper: 989.4 TFLOP/s bf16, 3.35 TB/s HBM3, 80 GB.
H100_80GB = Gpu("h100-sxm", 989.4e12, 3.35e12, 80e9)
# InfiniBand 50 GB/s per GPU (8 x 400 Gb/s per node) at 0.9 efficiency (calculon-ai/calculon), for TP
# groups beyond one node.
INTER_NODE_BYTES_PER_S = 0.9 * 50e9
# One small all-reduce inside a node: ~6 us on 2 H100s with NVLS and CUDA graphs, more with more GPUs
# (NVIDIA/nccl#1259); 10 us taken.
ALL_REDUCE_LATENCY_S = 10e-6


@dataclass(frozen=True)
class ModelSize:
    """What the world needs of a model: parameters, layers, KV bytes per token (bf16), width, and the
    parameters of the head (which a pipeline's last stage runs)."""

    params: float
    layers: int
    kv_bytes_per_token: float
    hidden: int = 0
    head_params: float = 0.0


@lru_cache(maxsize=256)
def pipeline_stages(model: ModelSize, pp: int) -> tuple[tuple[float, int], ...]:
    """(parameters, layers) of the two stages that can be a pipeline's busiest when whole layers are
    spread over ``pp`` stages (at least one each) and the last stage also runs the head: the best such
    split (the one whose busiest stage holds the fewest parameters), as a tuned Megatron-LM or
    torch.distributed.pipelining job sets it. One stage when ``pp`` is 1."""
    if pp == 1:
        return ((model.params, model.layers),)
    layer = (model.params - model.head_params) / model.layers

    def stages(last: int) -> tuple[tuple[float, int], tuple[float, int]]:
        widest = -(-(model.layers - last) // (pp - 1))
        return (widest * layer, widest), (last * layer + model.head_params, last)

    best = min(range(1, model.layers - pp + 2), key=lambda last: max(p for p, _ in stages(last)))
    return stages(best)


@dataclass(frozen=True)
class StepStats:
    """One PPO step as a log reports it: sequences, prompt and response lengths."""

    batch: int
    prompt_mean: float
    response_mean: float
    response_max: int
    response_min: int = 1
    response_p90: float | None = None


@dataclass(frozen=True)
class Shape:
    """How a stage is laid out: tensor, pipeline and data parallel degrees, micro-batches (waves)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batches: int = 1
    devices_per_node: int = 8

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class WorldConstants:
    """The free constants, fitted to real logs (see ``fit``); the defaults are priors before fitting."""

    generate_fixed_s: float = 1.0  # per generation call
    decode_step_s: float = 1e-3  # per decode iteration of a replica, eager engine (enforce_eager)
    decode_step_graphs_s: float = 1e-3  # per decode iteration of a replica, CUDA-graph engine
    infer_fixed_s: float = 0.5  # per forward-only pass over the batch
    train_fixed_s: float = 1.0  # per train stage (all its micro-batches and optimizer steps)
    mfu: float = 0.4  # share of peak FLOP/s reached by infer/train passes
    hbm_efficiency: float = 0.8  # share of HBM bandwidth reached by decode
    kv_share: float = 0.9  # share of the free device memory the engine gives the KV cache (vLLM's default)
    length_concentration: float = 4.0  # Beta a + b of the response-length draw when no p90 is given
    max_num_seqs: int = 1024  # sequences one engine runs at once (verl's rollout default max_num_seqs)


# ``benchmarks/validate_cost_model.py`` fit on both Qwen2.5-0.5B verl logs (its "constants": passes on
# verl's padded batches, generation less the old-log-prob forward verl runs inside it; the rest are the
# priors above). mfu reaches its 0.9 bound: those passes are bound by their fixed costs, not FLOPs.
FITTED = WorldConstants(
    generate_fixed_s=12.27, decode_step_s=0.0, infer_fixed_s=5.11, train_fixed_s=17.43, mfu=0.9
)
# ``python -m benchmarks.fit_world_7b`` fit on three published 7B verl runs (deepseek-llm-7b PPO on 4 GPUs,
# Megatron TP4, vLLM TP4; Qwen2-7B GRPO on 16 GPUs, Megatron TP4 PP2, vLLM TP2; eric-haibin-lin/verl-data;
# and verl's vLLM 0.7 note, Qwen2-7B generation on 8 GPUs eager and with CUDA graphs), H100-class GPUs
# assumed: the logs do not say, and the Qwen run's logged actor MFU 0.290 is what this world's FLOPs
# give at that peak. Held out: verl's Qwen2-7B FSDP2 run on 8 GPUs and OpenRLHF's Llama-2-7B benchmark.
# A decode iteration's fixed cost: 11.7 ms eager (verl's setting in those runs), 5.2 ms with CUDA graphs.
FITTED_7B = WorldConstants(
    generate_fixed_s=26.95,
    decode_step_s=0.011661,
    decode_step_graphs_s=0.005241,
    infer_fixed_s=3.11,
    train_fixed_s=0.0,
    mfu=0.291,
)
FITTED_BY_PARAMS = ((2e9, FITTED), (float("inf"), FITTED_7B))  # up to 2B: the 0.5B fit; above: 7B's


def constants_for(params: float) -> WorldConstants:
    """The fitted constants of the size class of a model of ``params`` parameters."""
    return next(c for top, c in FITTED_BY_PARAMS if params <= top)


def draw_lengths(stats: StepStats, rng: np.random.Generator, concentration: float) -> np.ndarray:
    """Response length of every sequence: min + (max - min) x Beta with the step's mean (and p90); the
    max is the engine's limit, which the longest drawn sequence reaches only as often as the Beta says
    (the world's own tail: the cost model plans for the logged max)."""
    lo, hi = max(stats.response_min, 1), max(stats.response_max, 1)
    if hi <= lo:
        return np.full(stats.batch, hi, dtype=np.int64)
    share = float(np.clip((stats.response_mean - lo) / (hi - lo), 0.02, 0.98))
    if stats.response_p90 is not None:
        concentration = concentration_for(share, (stats.response_p90 - lo) / (hi - lo))
    x = rng.beta(share * concentration, (1 - share) * concentration, size=stats.batch)
    return np.rint(lo + x * (hi - lo)).astype(np.int64)


_GRID = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
_P90: dict[tuple[float, float], float] = {}


def concentration_for(share: float, p90_share: float) -> float:
    """The Beta concentration (a + b) on ``_GRID`` whose 0.9 quantile is nearest ``p90_share``."""
    best, err = _GRID[0], np.inf
    rng = np.random.default_rng(0)
    for c in _GRID:
        key = (round(share, 3), c)
        if key not in _P90:
            _P90[key] = float(np.quantile(rng.beta(key[0] * c, (1 - key[0]) * c, size=4096), 0.9))
        if abs(_P90[key] - p90_share) < err:
            best, err = c, abs(_P90[key] - p90_share)
    return best


def makespan(lengths: np.ndarray, slots: int) -> int:
    """Decode iterations of first-come-first-served continuous batching on ``slots`` slots."""
    if len(lengths) <= slots:
        return int(lengths.max(initial=0))
    heap = lengths[:slots].tolist()
    heapq.heapify(heap)
    for length in lengths[slots:].tolist():
        heapq.heapreplace(heap, heap[0] + length)
    return max(heap)


def tp_link(shape: Shape, gpu: Gpu) -> float:
    return gpu.link_bytes_per_s if shape.tp <= shape.devices_per_node else INTER_NODE_BYTES_PER_S


def decode_overhead_s(c: WorldConstants, cuda_graphs: bool) -> float:
    """The fixed seconds of one decode iteration: kernel launches, scheduling and sampling, which CUDA
    graphs cut (``decode_step_graphs_s``) and an eager engine pays in full (``decode_step_s``)."""
    return c.decode_step_graphs_s if cuda_graphs else c.decode_step_s


def generation_s(
    lengths: np.ndarray,
    prompt: float,
    model: ModelSize,
    gpu: Gpu,
    c: WorldConstants,
    shape: Shape,
    *,
    cuda_graphs: bool = False,
) -> float:
    """One step's generation: prefill, then each replica's waves one after another, the slowest replica.
    A decode iteration costs its fixed overhead (``decode_overhead_s``: the engine's mode), two
    all-reduces per layer under TP, and the larger of reading the weights and the running sequences'
    KV cache over a tp-th of the HBM and their FLOPs (summed over the replica's iterations)."""
    tp, shard = shape.tp, shape.tp * shape.pp
    weights = 2.0 * model.params
    free = max(gpu.memory_bytes * c.kv_share - weights / shard, 0.05 * gpu.memory_bytes)
    slots = max(1, int(free / (model.kv_bytes_per_token / shard * (prompt + float(lengths.mean())))))
    slots = min(slots, c.max_num_seqs)
    bw, flops = gpu.hbm_bytes_per_s * c.hbm_efficiency, gpu.peak_flops * c.mfu
    all_reduces = 2 * model.layers * ALL_REDUCE_LATENCY_S if tp > 1 else 0.0
    per_iter = decode_overhead_s(c, cuda_graphs) + all_reduces
    dp = shape.dp
    usable = len(lengths) - len(lengths) % dp
    parts = lengths[:usable].reshape(dp, -1)
    waves = max(1, min(shape.micro_batches, parts.shape[1]))
    cut = parts.shape[1] - parts.shape[1] % waves
    chunks = parts[:, :cut].reshape(dp, waves, -1)
    if chunks.shape[2] <= slots:
        iters = chunks.max(axis=2).sum(axis=1).astype(float)
    else:
        iters = np.array([sum(makespan(w, slots) for w in r) for r in chunks], dtype=float)
    lf = parts.astype(float)
    ctx = (lf * prompt + lf * (lf + 1) / 2).sum(axis=1)  # KV tokens read, summed over iterations
    memory = iters * weights / tp / bw + ctx * model.kv_bytes_per_token / tp / bw
    compute = 2.0 * model.params * lf.sum(axis=1) / (tp * flops)
    tokens = lf.sum(axis=1)
    replica = iters * per_iter + np.maximum(memory, compute)
    if tp > 1:  # two all-reduces per layer of each running sequence's hidden state (bf16, ring)
        ring = 2.0 * (tp - 1) / tp
        replica = replica + tokens * model.layers * 2 * model.hidden * 2.0 * ring / tp_link(shape, gpu)
    prefill = 2.0 * model.params * len(lengths) * prompt / (flops * shape.devices)
    return c.generate_fixed_s + prefill + float(replica.max())


def balanced_replicas(lengths: np.ndarray, dp: int) -> np.ndarray:
    """Response lengths per data-parallel replica of a pass, ``[dp, n]``: sorted longest first and
    dealt out in a snake (replica 1 to dp, then dp to 1), so each replica holds about the mean. The
    systems this world stands for balance the passes' ranks by tokens (verl's ``trainer.balance_batch``,
    on by default; Nereus's dispatch); generation cannot, its lengths are not known before it runs."""
    usable = len(lengths) - len(lengths) % dp
    ranked = np.sort(lengths[:usable])[::-1].reshape(-1, dp)
    ranked[1::2] = ranked[1::2, ::-1]
    return ranked.T


def pass_parts(
    lengths: np.ndarray, prompt: float, model: ModelSize, gpu: Gpu, shape: Shape, *, train: bool
) -> tuple[float, float]:
    """A forward (infer) or forward + backward (train) pass over the batch: its seconds at the full peak
    FLOP/s on the slowest replica, bubble included, and the seconds that do not scale with MFU (TP
    all-reduces, the Adam step)."""
    mult, n_ar = (6.0, 4) if train else (2.0, 2)
    seq = prompt + balanced_replicas(lengths, shape.dp).astype(float)
    stages = pipeline_stages(model, shape.pp)
    flops = np.max(  # the busiest stage's, per replica
        [
            mult * (params * seq + 2.0 * layers * model.hidden * seq**2).sum(axis=1)
            for params, layers in stages
        ],
        axis=0,
    )
    bubble = (shape.micro_batches + shape.pp - 1) / shape.micro_batches
    peak_s = float(flops.max()) / (gpu.peak_flops * shape.tp) * bubble
    other = 0.0
    if shape.tp > 1:
        tokens = float(seq.sum(axis=1).max())
        ring = 2.0 * (shape.tp - 1) / shape.tp
        volume = tokens * max(layers for _, layers in stages) * n_ar * model.hidden * 2.0 * ring
        other += volume / tp_link(shape, gpu)
        other += shape.micro_batches * model.layers * n_ar * ALL_REDUCE_LATENCY_S
    if train:  # Adam reads and writes ~16 bytes/param of state, sharded over the devices (ZeRO/FSDP)
        other += 16.0 * 2 * model.params / shape.devices / gpu.hbm_bytes_per_s
    return peak_s, other


def pass_time_s(
    lengths: np.ndarray,
    prompt: float,
    model: ModelSize,
    gpu: Gpu,
    c: WorldConstants,
    shape: Shape,
    *,
    train: bool,
    recompute: bool = False,
) -> float:
    """An infer or train stage; full activation recomputation adds one forward (8/6 of the FLOPs)."""
    peak_s, other = pass_parts(lengths, prompt, model, gpu, shape, train=train)
    if train and recompute:
        peak_s *= 8.0 / 6.0
    return (c.train_fixed_s if train else c.infer_fixed_s) + peak_s / c.mfu + other


KINDS = ("generate", "infer", "train")


def stage_s(
    kind: str,
    stats: StepStats,
    model: ModelSize,
    gpu: Gpu,
    c: WorldConstants,
    *,
    tp: int,
    dp: int,
    seed: int = 0,
) -> float:
    """One stage of one logged step (lengths drawn with ``seed``)."""
    lengths = draw_lengths(stats, np.random.default_rng(seed), c.length_concentration)
    shape = Shape(tp=tp, dp=dp)
    if kind == "generate":
        return generation_s(lengths, stats.prompt_mean, model, gpu, c, shape)
    return pass_time_s(lengths, stats.prompt_mean, model, gpu, c, shape, train=kind == "train")


def generate_s(
    stats: StepStats, model: ModelSize, gpu: Gpu, c: WorldConstants, *, tp: int, dp: int, seed: int = 0
) -> float:
    return stage_s("generate", stats, model, gpu, c, tp=tp, dp=dp, seed=seed)


Row = tuple[str, StepStats, ModelSize, Gpu, int, int, float]


def fit(rows: Sequence[Row], start: WorldConstants) -> WorldConstants:
    """Fit the fixed costs and ``mfu`` by least squares on (kind, stats, model, gpu, tp, dp, seconds):
    each stage time is linear in its fixed cost and in the per-unit cost it scales (decode
    iterations; 1/mfu), so one linear solve per kind, clipped to physical values."""
    c = start
    gen = [r for r in rows if r[0] == "generate"]
    if gen:
        zero = replace(c, generate_fixed_s=0.0, decode_step_s=0.0)
        one = replace(zero, decode_step_s=1.0)

        def run(cs: WorldConstants) -> np.ndarray:
            return np.array(
                [generate_s(s, m, g, cs, tp=t, dp=d, seed=i) for i, (_, s, m, g, t, d, _) in enumerate(gen)]
            )

        bare = run(zero)
        per = run(one) - bare
        y = np.array([r[-1] for r in gen]) - bare
        (fixed, step), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(per), per]), y, rcond=None)
        c = replace(c, generate_fixed_s=max(float(fixed), 0.0), decode_step_s=max(float(step), 0.0))
    passes = [r for r in rows if r[0] != "generate"]
    if passes:
        parts = np.array(
            [
                pass_parts(
                    draw_lengths(s, np.random.default_rng(i), c.length_concentration),
                    s.prompt_mean,
                    m,
                    g,
                    Shape(tp=t, dp=d),
                    train=k == "train",
                )
                for i, (k, s, m, g, t, d, _) in enumerate(passes)
            ]
        )
        is_train = np.array([r[0] == "train" for r in passes], dtype=float)
        design = np.column_stack([1.0 - is_train, is_train, parts[:, 0]])
        y = np.array([r[-1] for r in passes]) - parts[:, 1]
        (fi, ft, inv_mfu), *_ = np.linalg.lstsq(design, y, rcond=None)
        mfu = float(np.clip(1.0 / max(float(inv_mfu), 1e-9), 0.01, 0.9))
        c = replace(c, infer_fixed_s=max(float(fi), 0.0), train_fixed_s=max(float(ft), 0.0), mfu=mfu)
    return c
