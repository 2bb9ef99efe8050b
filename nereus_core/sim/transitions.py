"""What a transition, a weight sync and a restart really take in the simulated world: fixed costs.

Boundary: pure arithmetic over two plans' layouts and, for a transition, the cost model's byte
accounting (``TransitionEstimate.wire_s``: the busiest port's bytes at link speed, taken as the
physics of the moved bytes); the fixed costs added here and the weight sync (``sync_s``) are the
world's, from published GPU figures. Figures measured by this repository's CPU runs (process groups of gloo on
one host) are not used: they say nothing of NCCL on GPUs.

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
    changed = [
        s
        for s, v in new.items()
        if placement_changed
        or s not in old
        or (old[s].tp, old[s].pp, old[s].dp, old[s].devices) != (v.tp, v.pp, v.dp, v.devices)
    ]
    if not changed:
        return 0.0
    groups = max(group_s(largest_group(new[s])) for s in changed)
    engine = ENGINE_REBUILD_S if GENERATE in changed else 0.0
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
