"""What a checkpoint write, its host staging, a rehydration and a live-state verification really take
in the simulated world: the world's own arithmetic and constants, from published figures.

Boundary: pure arithmetic over a plan's layouts and each model's parameter count; it shares no
formula or constant with the cost model (``nereus_core/cost/transition_cost.py`` prices the same
acts for the controller), and nothing measured by this repository's CPU runs is used.

- A model's state, as the runtime's snapshot holds it (``tasks/snapshots.py``): a trained model's
  fp32 parameters and its two fp32 AdamW moments (12 bytes per parameter), a frozen model's bf16
  weights (2 bytes per parameter), held by the stage that owns the model's state
  (``ModelStage.owns_state``), each distinct piece written once by one holder: spread evenly over
  that stage's devices.
- A synchronous write (``write_s``): every node writes its devices' pieces at a node's share of a
  parallel file system, all nodes at once; the job waits for the slowest node. 1.80 GB/s per node:
  Llama-3-8B's bf16 weights (16.06 GB) sharded over 8 ranks of one node saved in 8.94 s
  (AlibabaPAI/torchacc#16, "shard_model save", fsdp=8, CPFS); the same issue's full optimizer save
  (Llama-3-8B, ~53 s from one rank) is of the same order. The file system is taken to scale with
  the nodes (no aggregate cap).
- An asynchronous write (``staging_s``): the job waits only for the device-to-host copy into pinned
  memory (PyTorch DCP ``async_save``), the write runs in the background: each device's pieces over
  PCIe Gen5 (64 GB/s per direction), at least the 0.78 s staging held Llama-3-70B training on 1,856
  H200 (PyTorch blog "6x faster Async Checkpointing in PyTorch", 2025-04-30).
- A rehydration (``read_s``, a switch onto a new device set): every device reads its own pieces back
  at 0.81 GB/s, one reading process's rate: Llama-3-8B's 8 weight shards (16.06 GB) read by one rank
  in 19.84 s (AlibabaPAI/torchacc#16, "read shard model", fsdp=8); all devices at once, the file
  system taken to scale as for writes (the measurement had one reader, the writes' had eight).
- A verification (``verify_s``, ``job.verify_transitions``): every model's whole state gathered to
  the driver over one node's InfiniBand (8 x 400 Gb/s at 0.9 efficiency) and hashed by one core's
  sha256, before the moves and after: 1 GiB in 0.45 s with SHA-NI (openssl/openssl#29340, coreutils
  ``sha256sum`` on OpenSSL 3.5), 2.39 GB/s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nereus_core.config import RecoveryMode, recovery_write
from nereus_core.layout import Layout
from nereus_core.plan import ModelStage, model_of
from nereus_core.sim.memory import FROZEN_BYTES, STATE_BYTES
from nereus_core.sim.transitions import IB_BYTES_PER_S

TRAINED_BYTES_PER_PARAM = STATE_BYTES["optimizer"]  # fp32 parameter, AdamW exp_avg, exp_avg_sq
FROZEN_BYTES_PER_PARAM = FROZEN_BYTES  # bf16 weights
NODE_WRITE_BYTES_PER_S = 16.06e9 / 8.94  # AlibabaPAI/torchacc#16: 8B bf16 shard save, fsdp=8
READ_BYTES_PER_S = 16.06e9 / 19.84  # AlibabaPAI/torchacc#16: read shard model, one rank
PCIE_BYTES_PER_S = 64e9  # PCIe Gen5 x16, per direction
STAGING_FLOOR_S = 0.78  # PyTorch blog 2025-04-30: DCP async_save staging, Llama-3-70B, 1,856 H200
SHA256_BYTES_PER_S = 2**30 / 0.45  # openssl/openssl#29340: sha256sum of 1 GiB with SHA-NI


def state_bytes(stage: str, params: float) -> float:
    """Bytes of the state ``stage`` owns: a train stage's fp32 parameters and moments, else bf16."""
    return params * (TRAINED_BYTES_PER_PARAM if ModelStage(stage).trains else FROZEN_BYTES_PER_PARAM)


def device_bytes(layouts: Mapping[str, Layout], params: Mapping[str, float]) -> dict[int, float]:
    """Bytes of checkpointed state each device holds: every owner's state spread over its devices."""
    out: dict[int, float] = {}
    for stage, layout in layouts.items():
        if not ModelStage(stage).owns_state:
            continue
        share = state_bytes(stage, params[model_of(stage)]) / len(layout.devices)
        for d in layout.devices:
            out[d] = out.get(d, 0.0) + share
    return out


def _busiest_node(layouts: Mapping[str, Layout], params: Mapping[str, float], per_node: int) -> float:
    nodes: dict[int, float] = {}
    for d, b in device_bytes(layouts, params).items():
        nodes[d // per_node] = nodes.get(d // per_node, 0.0) + b
    return max(nodes.values(), default=0.0)


def write_s(layouts: Mapping[str, Layout], params: Mapping[str, float], per_node: int) -> float:
    """Seconds a synchronous checkpoint of ``layouts`` holds the job: its busiest node's write."""
    return _busiest_node(layouts, params, per_node) / NODE_WRITE_BYTES_PER_S


def staging_s(layouts: Mapping[str, Layout], params: Mapping[str, float]) -> float:
    """Seconds an asynchronous checkpoint holds the job: its busiest device's copy to host memory."""
    top = max(device_bytes(layouts, params).values(), default=0.0)
    return max(STAGING_FLOOR_S, top / PCIE_BYTES_PER_S) if top else 0.0


def read_s(layouts: Mapping[str, Layout], params: Mapping[str, float]) -> float:
    """Seconds a rehydration onto ``layouts`` takes: its busiest device's read of the checkpoint."""
    return max(device_bytes(layouts, params).values(), default=0.0) / READ_BYTES_PER_S


@dataclass(frozen=True)
class SwitchWrites:
    """What Nereus's runtime adds to a switch: its recovery point (``job.switch_recovery``) and,
    with ``verify``, the live state's digests (``job.verify_transitions``)."""

    recovery: RecoveryMode
    verify: bool = False


def switch_s(
    old: Mapping[str, Layout],
    new: Mapping[str, Layout],
    params: Mapping[str, float],
    per_node: int,
    writes: SwitchWrites,
    *,
    durable: bool,
) -> float:
    """Seconds ``writes`` add to a switch from ``old`` to ``new`` layouts. The recovery point is
    written as ``recovery_write`` says (a ``durable`` switch, onto a new device set, writes the
    checkpoint synchronously whatever the mode, then reads it back onto ``new``): ``sync`` writes
    ``old``'s checkpoint, ``async`` stages ``old``'s state in host memory, ``none`` nothing."""
    mode = recovery_write(writes.recovery, durable=durable)
    if mode == "sync":
        seconds = write_s(old, params, per_node)
    else:
        seconds = staging_s(old, params) if mode == "async" else 0.0
    seconds += read_s(new, params) if durable else 0.0
    return seconds + (verify_s(new, params) if writes.verify else 0.0)


def verify_s(layouts: Mapping[str, Layout], params: Mapping[str, float]) -> float:
    """Seconds of a switch's verification: every model's state to the driver and hashed, twice."""
    total = sum(device_bytes(layouts, params).values())
    return 2.0 * (total / IB_BYTES_PER_S + total / SHA256_BYTES_PER_S)
