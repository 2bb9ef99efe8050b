"""What a transition, a weight sync and a restart really take in the simulated world: fixed costs.

Boundary: pure arithmetic over two plans' layouts and the cost model's byte accounting
(``TransitionEstimate.wire_s``: the busiest port's bytes at link speed, taken as the
physics of the moved bytes); the fixed costs added here are the world's, from published
GPU figures. Figures measured by this repository's CPU runs (process groups of gloo on
one host) are not used: they say nothing of NCCL on GPUs.

- Process-group creation per changed layout, for its largest group: 2 s at 8 ranks
  (NVIDIA/nccl#534: 8 communicators of 8 ranks in 16.3 s) growing to 150 s at 4,096
  ranks (NVIDIA/nccl#1156: "2.5-minute init time at large scale (above certain K GPUs)";
  4,096 taken), a power law between. Disjoint groups are created in parallel.
- Rebuilding the generation engine when its layout changes: 41.6 s (vllm-project/vllm#20264,
  a Llama vLLM engine: "init engine (profile, create kv cache, warmup model) took 34.11 s"
  plus 7.51 s of Dynamo bytecode transform with the compile cache warm).
- A restart after a step fails for memory: a new engine, the world's process groups, and
  the lost step (charged by the engine).
- Weight sync each step: at least the measured 0.57 s (colocated FSDP -> vLLM) or 0.70 s
  (NCCL broadcast) for a 7-8B actor (volcengine/verl pull request 116).
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


def sync_floor_s(colocated: bool) -> float:
    return SYNC_FLOOR_COLOCATED_S if colocated else SYNC_FLOOR_NCCL_S
