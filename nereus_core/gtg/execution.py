"""What the transition executor runs: the GTG's operations grouped into units, in waves.

The device side carries out a unit of ops in one collective call, so this module groups the
GTG's ops into the units the executor has:
- ``move:<stage>``: a live model-stage's allocs, transfers, copies and frees (``engine.reshard``:
  every device of both layouts allocates its new shard, the pieces move, the old shards go);
- ``unload:<stage>`` and ``load:<stage>``: a durable model-stage's snapshot and frees, then its
  allocs and rehydrations (the snapshot is the checkpoint the transition starts from).
It then proves, with the GTG's own memory replay, that running the units in the returned order
never puts a device over its capacity:

1. every data or memory edge between ops of two different units becomes an edge between the
   units (port edges only order transfers that share a link, for timing: units sharing a device
   may run at once and share its bandwidth); a cycle means the GTG's order interleaves two
   units' ops, which one call per unit cannot do: another order is searched (below);
2. the units' levels are the waves (a wave's units may run at once);
3. each wave is replayed as one GTG wave (all its allocations before any of its frees, the worst
   case of running its units together); if a device overflows, the units run one per wave in
   topological order and are replayed again;
4. if that overflows too, or step 1 found a cycle, units are ordered one at a time by the data
   edges alone, each the first ready unit that fits the devices as they are then, and the order is
   replayed once more; if no ready unit fits at some point, there is no safe schedule.

Boundary: pure planning over a ``TransitionGraph``; flows/job/transition.py executes the waves.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from nereus_core.gtg.graph import TransitionGraph, device_loads, replay_peaks, resolve_capacities


@dataclass(frozen=True)
class StageSchedule:
    """Units in waves, with the op ids of each unit and the replayed peak per device."""

    waves: tuple[tuple[str, ...], ...]
    ops: dict[str, tuple[str, ...]]  # unit -> its op ids, in the GTG's order
    peak_bytes: dict[int, int]
    serial: bool  # True when the units had to run one per wave to stay within capacity
    follows_gtg: bool = True  # False: ordered by data edges and the replay, not the GTG's memory edges

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(s for wave in self.waves for s in wave)

    @property
    def kept_sources(self) -> frozenset[str]:
        """The model-stages whose old shards a live run of this schedule keeps until the switch ends
        (a rollback's source, never written again): every one it moves when it is one wave of live
        moves, whose replay already counts every old shard beside every new one; none otherwise
        (several waves free a wave's old shards before the next allocates: that order is what
        makes them fit)."""
        if len(self.waves) != 1 or not all(u.startswith("move:") for u in self.order):
            return frozenset()
        return frozenset(u.removeprefix("move:") for u in self.order)


class NoStageSchedule(ValueError):
    """No order of whole units is memory-safe (or the GTG interleaves two units)."""


def unit_of(graph: TransitionGraph, op_id: str) -> str:
    """The unit an op belongs to ('' for regroup and commit): ``move:``, ``unload:`` or ``load:``."""
    op = graph.op(op_id)
    if not op.stage:
        return ""
    if graph.moves[op.stage].mode != "durable":
        return f"move:{op.stage}"
    return f"{'unload' if op.kind in ('snapshot', 'free') else 'load'}:{op.stage}"


def stage_schedule(graph: TransitionGraph, capacities: dict[int, int]) -> StageSchedule:
    """The executed schedule of ``graph`` (see the module docstring); raises ``NoStageSchedule``.
    ``capacities`` as for ``build_gtg``."""
    ops: dict[str, list[str]] = defaultdict(list)
    for op in graph.ops:
        if unit := unit_of(graph, op.id):
            ops[unit].append(op.id)
    frozen = {u: tuple(v) for u, v in ops.items()}
    initial = device_loads(graph.moves, "old", graph.dtype_bytes)
    final = device_loads(graph.moves, "new", graph.dtype_bytes)
    caps = resolve_capacities(capacities, initial, final)
    tried = []
    try:  # the GTG's own order (data and memory edges) at the units' granularity; its port edges
        # only sequence transfers that share a link (timing), so units that share one may run together
        levels = _levels(sorted(frozen), _unit_edges(graph, kinds=("data", "memory")))
        for serial, waves in ((False, levels), (True, tuple((u,) for wave in levels for u in wave))):
            peak = _replay(graph, waves, frozen, initial)
            if all(peak[d] <= caps.get(d, peak[d]) for d in peak):
                return StageSchedule(waves, frozen, peak, serial)
        tried.append("the GTG's order overflows a device at the units' granularity")
    except NoStageSchedule as err:
        tried.append(str(err))
    # The GTG's memory edges order single allocations; whole units may need another order: search one
    # that respects the data edges and fits (checked by the same replay).
    order = _fitting_order(graph, frozen, _unit_edges(graph, kinds=("data",)), initial, caps)
    if order is not None:
        waves = tuple((u,) for u in order)
        return StageSchedule(waves, frozen, _replay(graph, waves, frozen, initial), True, follows_gtg=False)
    raise NoStageSchedule(f"{'; '.join(tried)}; and no order of whole units fits the devices")


def _unit_edges(graph: TransitionGraph, *, kinds: tuple[str, ...]) -> dict[str, set[str]]:
    after: dict[str, set[str]] = defaultdict(set)
    for e in graph.edges:
        a, b = unit_of(graph, e.before), unit_of(graph, e.after)
        if e.kind in kinds and a and b and a != b:
            after[a].add(b)
    return after


def _fitting_order(
    graph: TransitionGraph,
    ops: dict[str, tuple[str, ...]],
    after: dict[str, set[str]],
    initial: dict[int, int],
    caps: dict[int, int],
) -> tuple[str, ...] | None:
    """Units one at a time, each once its data predecessors ran, unloads first, then the unit that
    leaves the most room; None when at some point no ready unit fits."""
    waiting = {u: sum(u in after[p] for p in ops) for u in ops}
    load, order = dict(initial), []

    def delta(unit: str) -> tuple[dict[int, int], dict[int, int]]:
        alloc: dict[int, int] = defaultdict(int)
        free: dict[int, int] = defaultdict(int)
        for op in (graph.op(i) for i in ops[unit]):
            if op.kind == "alloc":
                alloc[op.device] += op.nbytes  # type: ignore[index]
            elif op.kind == "free":
                free[op.device] += op.nbytes  # type: ignore[index]
        return alloc, free

    while len(order) < len(ops):
        fits = []
        for unit in sorted(u for u, n in waiting.items() if n == 0 and u not in order):
            alloc, free = delta(unit)
            if all(load.get(d, 0) + b <= caps.get(d, load.get(d, 0) + b) for d, b in alloc.items()):
                fits.append((not unit.startswith("unload:"), sum(alloc.values()) - sum(free.values()), unit))
        if not fits:
            return None
        unit = min(fits)[2]
        alloc, free = delta(unit)
        for d, b in alloc.items():
            load[d] = load.get(d, 0) + b
        for d, b in free.items():
            load[d] -= b
        order.append(unit)
        for nxt in after[unit]:
            waiting[nxt] -= 1
    return tuple(order)


def _levels(stages: list[str], after: dict[str, set[str]]) -> tuple[tuple[str, ...], ...]:
    after = defaultdict(set, after)
    indegree = {s: 0 for s in stages}
    for a in stages:
        for b in after[a]:
            indegree[b] += 1
    ready, waves, seen = sorted(s for s in stages if indegree[s] == 0), [], 0
    while ready:
        waves.append(tuple(ready))
        seen += len(ready)
        nxt = []
        for a in ready:
            for b in after[a]:
                indegree[b] -= 1
                if indegree[b] == 0:
                    nxt.append(b)
        ready = sorted(nxt)
    if seen != len(stages):
        stuck = sorted(s for s in stages if indegree[s] > 0)
        raise NoStageSchedule(f"the GTG interleaves the ops of {stuck}: no order of whole units")
    return tuple(waves)


def _replay(
    graph: TransitionGraph,
    waves: tuple[tuple[str, ...], ...],
    ops: dict[str, tuple[str, ...]],
    initial: dict[int, int],
) -> dict[int, int]:
    op_waves = tuple(tuple(i for s in wave for i in ops[s]) for wave in waves)
    by_id = {op.id: op for op in graph.ops}
    peak, _, _ = replay_peaks(op_waves, by_id, initial)
    return peak
