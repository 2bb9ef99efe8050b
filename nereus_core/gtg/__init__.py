"""The Global Transition Graph (GTG): how a running job moves from plan A to plan B.

What the Nereus paper says ("Nereus: adaptive parallelism for LLM post-training", arXiv 2609.34645,
"Design"): a GTG "orders the transformations and
GPU transfers of all EMUs: dependencies first (upstream before downstream), least contention for
devices, no deadlock". Here that becomes:

1. Operations per changed model-stage (unchanged ones produce none): ``alloc`` a new shard,
   ``transfer``/``copy`` the regions ``emu.plan_reshard`` prescribes, ``free`` an old shard once
   nothing reads it; on the durable route ``snapshot`` each distinct old box once, ``free``, then
   ``alloc`` + ``rehydrate``. One ``regroup`` (the new process groups) precedes every transfer;
   ``commit`` (the plan switch) comes last.
2. Memory: a device holds its untouched model-stages, the old shards not yet freed and the new
   shards allocated (params, grads and optimizer state per ``emu.bytes_per_device``, each tensor
   at its own size: bf16 weights and gradients, fp32 masters and moments; transfer
   staging buffers are not counted, and a live move holds a model-stage's old and new shard on a
   device at once: no in-place reshard). ``memory.find_order`` searches an order of allocs and
   frees in which no allocation exceeds a device's capacity (exact, up to ``search_budget``
   branching states), and ``memory.memory_edges`` turns it into ``memory`` edges (free before
   alloc, alloc chains on tight devices) under which *every* topological order is safe. No order
   means a deadlock (a model-stage's own old and new shards collide, or frees wait in a cycle on
   allocations that do not fit): the fewest, then cheapest, model-stages go durable ("mixed"),
   or all of them ("durable", peak max(old, new) per device). If plan B alone does not fit a
   device, no order exists and ``TransitionInfeasible`` names it.
3. Time (``schedule``): ops last ``LinkModel.duration`` (bytes / bandwidth + overhead) and queue
   on per-device ports (send, recv, copy, store); a list schedule fixes each port's order as
   ``port`` edges, and the longest path through all edges is the critical path, whose length
   (``critical_path_s``) feeds the cost model's transition cost. ``waves`` are the levels of that
   DAG, for an executor that runs in lock-step (``waves_s``: its time).

Boundary: planning over shapes only (no processes, files or storage); the transition flow in
flows/ runs the ops and journals them by ``Op.id``.
"""

from __future__ import annotations

from nereus_core.gtg.build import build_gtg, write_assignment
from nereus_core.gtg.graph import Route, StageMove, TransitionGraph
from nereus_core.gtg.ops import Edge, LinkModel, Op, ScheduleInvalid, TransitionInfeasible

__all__ = [
    "Edge",
    "LinkModel",
    "Op",
    "Route",
    "ScheduleInvalid",
    "StageMove",
    "TransitionGraph",
    "TransitionInfeasible",
    "build_gtg",
    "write_assignment",
]
