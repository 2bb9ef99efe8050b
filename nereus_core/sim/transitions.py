"""What a transition, a weight sync and a restart really take in the simulated world.

Boundary: pure arithmetic over two plans' layouts and each model's parameter count, the world's own
(it shares no formula with the cost model's EMU exchange plan): the moved bytes (``moved_s``), the
fixed costs and the weight sync (``sync_s``), from published GPU figures. Figures measured by this
repository's CPU runs (process groups of gloo on one host) are not used: they say nothing of NCCL on
GPUs.

- Moved bytes (``moved_s``): a model-stage's bytes (its checkpointed state where it owns the model's
  state, ``checkpoints.state_bytes``; a bf16 copy of the weights otherwise) lie on a line cut into
  tp x pp equal pieces, pipeline-major, and every data-parallel replica holds all of them. A device
  of the new layout receives its new piece less what it held of it before; devices receive at once,
  each over NVLink when an old holder of the stage shares its node, else over its InfiniBand port;
  the switch waits for the device that receives most.

- Process-group creation per changed layout, for its largest group: 2 s at 8 ranks
  (NVIDIA/nccl#534: 8 communicators of 8 ranks in 16.3 s) growing to 150 s at 4,096
  ranks (NVIDIA/nccl#1156: "2.5-minute init time at large scale (above certain K GPUs)";
  4,096 taken), a power law between. Disjoint groups are created in parallel.
- Rebuilding the generation engine when its layout changes: 41.6 s (vllm-project/vllm#20264,
  a Llama vLLM engine: "init engine (profile, create kv cache, warmup model) took 34.11 s"
  plus 7.51 s of Dynamo bytecode transform with the compile cache warm).
- A restart after a step fails for memory: a new rollout engine, the world's process groups, and
  the lost step (charged by the loop, ``loop.py``).
- Weight sync each step (``sync_s``, the world's own formula, not the cost model's): the
  bf16 weights once over the link the sync crosses, at least the measured 0.57 s (colocated
  FSDP -> vLLM by CUDA IPC) or 0.70 s (NCCL broadcast) for a 7-8B actor (volcengine/verl
  pull request 116). Colocated, the weights move at the rate that measurement implies
  (16.1 GB in 0.57 s); disaggregated, a bucketed broadcast pipelines them over NVLink inside a
  node or InfiniBand across nodes, whatever the engines' TP. A broadcast one tensor at a time
  (OpenRLHF's ``_broadcast_to_vllm``) adds a fixed cost per tensor: 20-40 s for an 8B model
  (291 tensors) gathered one matrix at a time (vllm-project/vllm#5723), ~80 s for 70B (723
  tensors) against a 2.8 s wire bound (OpenRLHF#647, from HybridFlow's fig. 14): 0.069 s per
  tensor, the low end, taken in its favour.
"""

from __future__ import annotations

import math

from nereus_core.layout import Layout
from nereus_core.plan import GENERATE

GROUP_S_AT_8 = 2.0  # NVIDIA/nccl#534
GROUP_S_AT_4096 = 150.0  # NVIDIA/nccl#1156
ENGINE_REBUILD_S = 34.11 + 7.51  # vllm-project/vllm#20264
SYNC_FLOOR_COLOCATED_S = 0.57  # volcengine/verl PR 116
SYNC_FLOOR_NCCL_S = 0.70  # volcengine/verl PR 116
IPC_BYTES_PER_S = 16.06e9 / 0.57  # Llama-3-8B bf16 weights in verl PR 116's colocated 0.57 s
NVLINK_BYTES_PER_S = 380e9  # NVLink 4 one way, measured (NVIDIA/nccl#1264)
IB_BYTES_PER_S = 0.9 * 50e9  # 8 x 400 Gb/s per node, at calculon-ai/calculon's 0.9 efficiency
PER_TENSOR_S = 20.0 / 291  # vllm-project/vllm#5723: 8B one matrix at a time, 20-40 s (low end)


def changed(old: dict[str, Layout], new: dict[str, Layout], *, placement_changed: bool) -> list[str]:
    """The model-stages of ``new`` whose state moves: new ones, and those on another placement (all of
    them when the plan's placement changed)."""
    return [s for s, v in new.items() if placement_changed or s not in old or not old[s].same_placement(v)]


def _piece(layout: Layout, device: int) -> tuple[float, float]:
    """The share of a stage's bytes ``device`` holds in ``layout``: [start, end) on the unit line."""
    i = layout.devices.index(device) % (layout.tp * layout.pp)
    n = layout.tp * layout.pp
    return i / n, (i + 1) / n


def moved_s(
    old: dict[str, Layout], new: dict[str, Layout], stage_bytes: dict[str, float], per_node: int
) -> float:
    """Seconds the moved bytes of a switch from ``old`` to ``new`` layouts take (the module's rule);
    ``stage_bytes`` is each model-stage's bytes."""
    received: dict[int, list[float]] = {}  # device -> [NVLink bytes, InfiniBand bytes]
    for stage in changed(old, new, placement_changed=False):
        v, before = new[stage], old.get(stage)
        held = set(before.devices) if before is not None else set()
        nodes = {d // per_node for d in held}
        for d in v.devices:
            lo, hi = _piece(v, d)
            kept = 0.0
            if before is not None and d in held:
                a, b = _piece(before, d)
                kept = max(0.0, min(hi, b) - max(lo, a))
            link = 0 if d // per_node in nodes else 1
            received.setdefault(d, [0.0, 0.0])[link] += (hi - lo - kept) * stage_bytes[stage]
    return max((nv / NVLINK_BYTES_PER_S + ib / IB_BYTES_PER_S for nv, ib in received.values()), default=0.0)


def group_s(ranks: int) -> float:
    """Seconds to create one NCCL communicator of ``ranks`` ranks (0 for one rank)."""
    if ranks <= 1:
        return 0.0
    slope = math.log(GROUP_S_AT_4096 / GROUP_S_AT_8) / math.log(4096 / 8)
    return GROUP_S_AT_8 * (ranks / 8) ** slope


def largest_group(layout: Layout) -> int:
    return max(layout.tp, layout.pp, layout.dp)


def fixed_s(old: dict[str, Layout], new: dict[str, Layout], placement_changed: bool) -> float:
    """Fixed seconds of moving from ``old`` to ``new`` layouts: the largest new process group of any
    changed stage (groups are created in parallel), and an engine rebuild if generation changed."""
    moved = changed(old, new, placement_changed=placement_changed)
    if not moved:
        return 0.0
    groups = max(group_s(largest_group(new[s])) for s in moved)
    engine = ENGINE_REBUILD_S if GENERATE in moved else 0.0
    return groups + engine


def restart_s(layouts: dict[str, Layout]) -> float:
    """Fixed seconds of restarting a job on ``layouts`` from its last checkpoint (engine and groups)."""
    groups = max((group_s(largest_group(v)) for v in layouts.values()), default=0.0)
    return groups + ENGINE_REBUILD_S


def sync_s(weight_bytes: float, *, colocated: bool, cross_node: bool, tensors: int = 0) -> float:
    """The weight sync in this world: ``weight_bytes`` once over the link, at least the measured floor;
    ``tensors`` > 0 broadcasts one tensor at a time at ``PER_TENSOR_S`` each (disaggregated only)."""
    if colocated:
        return max(SYNC_FLOOR_COLOCATED_S, weight_bytes / IPC_BYTES_PER_S)
    wire = weight_bytes / (IB_BYTES_PER_S if cross_node else NVLINK_BYTES_PER_S)
    return max(SYNC_FLOOR_NCCL_S, wire + tensors * PER_TENSOR_S)
