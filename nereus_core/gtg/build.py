"""Building the Global Transition Graph of a transition from plan A to plan B."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from itertools import combinations

from nereus_core.config import ModelConfig
from nereus_core.emu import Box, ReshardPlan, ShardMap, plan_reshard, shard_map
from nereus_core.gtg.graph import (
    Route,
    StageMove,
    TransitionGraph,
    device_loads,
    replay_peaks,
    resolve_capacities,
)
from nereus_core.gtg.memory import Deadlock, Events, Key, MemoryProblem, find_order, memory_edges
from nereus_core.gtg.ops import Edge, LinkModel, Op, TransitionInfeasible
from nereus_core.gtg.schedule import schedule
from nereus_core.layout import Layout

DEFAULT_LINK = LinkModel()


def build_gtg(
    plan_a: dict[str, Layout],
    plan_b: dict[str, Layout],
    models: dict[str, tuple[ModelConfig, bool]],
    capacities: dict[int, int],
    *,
    link: LinkModel = DEFAULT_LINK,
    allow_live: bool = True,
    search_budget: int = 500,
    dtype_bytes: int | None = None,
) -> TransitionGraph:
    """The GTG of A -> B: ops, data and memory edges, waves, route and critical path.

    ``models[stage] = (config, train)`` for every model-stage of the plans (both plans name the
    same model-stages). ``capacities``: bytes per device, for every device plan B uses (a device
    only plan A uses may be left out; it only gives memory back). Raises ``TransitionInfeasible``
    when plan B itself does not fit a device, ``ValueError`` on inconsistent input.
    ``dtype_bytes``: None sizes every tensor as the shard maps do (parameters in ``model.dtype``,
    optimizer state fp32), so the bytes and peaks are what the live reshard moves and holds; an
    int sets one size for every tensor instead (a uniform estimate).
    """
    moves = _moves(plan_a, plan_b, models)
    initial = device_loads(moves, "old", dtype_bytes)
    final = device_loads(moves, "new", dtype_bytes)
    caps = resolve_capacities(capacities, initial, final)
    _check_fits(moves, caps, final, dtype_bytes)
    changed = [s for s, m in moves.items() if m.changed]
    if not changed:
        return _assemble(
            moves, [], [], link, "live", "no model-stage changes its layout", initial, dtype_bytes
        )
    maps = {s: _maps(moves[s], dtype_bytes) for s in changed}
    plans = {s: plan_reshard(*maps[s]) for s in changed}
    durable, events, problem, reason = _choose_route(
        moves, plans, caps, allow_live, search_budget, dtype_bytes
    )
    moves = {
        s: replace(m, mode="durable" if s in durable else "live") if m.changed else m
        for s, m in moves.items()
    }
    ops: list[Op] = [Op("regroup")]
    edges: list[Edge] = []
    for s in changed:
        move = moves[s]
        if move.mode == "live":
            _live_ops(move, plans[s], problem, ops, edges)
        else:
            _durable_ops(move, maps[s], problem, ops, edges, dtype_bytes)
    for before, after, kind in memory_edges(problem, events):
        src = f"{'free' if kind == 'free' else 'alloc'}:{before[0]}:{before[1]}"
        edges.append(Edge(src, f"alloc:{after[0]}:{after[1]}", "memory"))
    has_succ = {e.before for e in edges}
    edges += [Edge(op.id, "commit", "data") for op in ops if op.id not in has_succ]
    ops.append(Op("commit"))
    route: Route = "live" if not durable else ("durable" if len(durable) == len(changed) else "mixed")
    return _assemble(moves, ops, edges, link, route, reason, initial, dtype_bytes)


def _moves(
    plan_a: dict[str, Layout], plan_b: dict[str, Layout], models: dict[str, tuple[ModelConfig, bool]]
) -> dict[str, StageMove]:
    if set(plan_a) != set(plan_b):
        only_a, only_b = sorted(set(plan_a) - set(plan_b)), sorted(set(plan_b) - set(plan_a))
        raise ValueError(
            f"plans A and B must name the same model-stages; only in A: {only_a}, only in B: {only_b}"
        )
    missing = sorted(s for s in plan_a if s not in models)
    if missing:
        raise ValueError(f"models has no (config, train) for {missing}; give one per model-stage")
    return {s: StageMove(s, models[s][0], models[s][1], plan_a[s], plan_b[s]) for s in sorted(plan_a)}


def _check_fits(
    moves: dict[str, StageMove], caps: dict[int, int], final: dict[int, int], dtype_bytes: int | None
) -> None:
    """Plan B alone must fit every device, or no route exists (the durable route needs exactly that)."""
    for d in sorted(final):
        if final[d] > caps[d]:
            parts = ", ".join(
                f"{s} {b} B"
                for s, m in moves.items()
                for dev, b in m.shard_bytes("new", dtype_bytes).items()
                if dev == d
            )
            raise TransitionInfeasible(
                f"device {d} (capacity {caps[d]} B) cannot hold plan B: it needs {final[d]} B ({parts}); "
                f"no transition order helps — give plan B more devices or a finer layout there"
            )


def _maps(move: StageMove, dtype_bytes: int | None) -> tuple[ShardMap, ShardMap]:
    old = shard_map(move.config, move.old, train=move.train, dtype_bytes=dtype_bytes)
    return old, shard_map(move.config, move.new, train=move.train, dtype_bytes=dtype_bytes)


def _problem(
    moves: dict[str, StageMove],
    plans: dict[str, ReshardPlan],
    caps: dict[int, int],
    durable: frozenset[str],
    dtype_bytes: int | None,
) -> MemoryProblem:
    base: dict[int, int] = defaultdict(int)
    old: dict[Key, int] = {}
    new: dict[Key, int] = {}
    needs: dict[Key, frozenset[Key]] = {}
    for s, move in moves.items():
        if not move.changed:
            for d, b in move.shard_bytes("old", dtype_bytes).items():
                base[d] += b
            continue
        old.update({(s, d): b for d, b in move.shard_bytes("old", dtype_bytes).items()})
        new.update({(s, d): b for d, b in move.shard_bytes("new", dtype_bytes).items()})
        # Live: an old shard is kept until every new shard of its model-stage is complete (copy, then
        # free), so a move that fails in a worker still has all of plan A to fall back on.
        targets = frozenset() if s in durable else frozenset((s, d) for d in move.new.devices)
        needs.update({(s, d): targets for d in move.old.devices})
    return MemoryProblem(caps, dict(base), old, new, needs)


def _choose_route(
    moves: dict[str, StageMove],
    plans: dict[str, ReshardPlan],
    caps: dict[int, int],
    allow_live: bool,
    budget: int,
    dtype_bytes: int | None,
) -> tuple[frozenset[str], Events, MemoryProblem, str]:
    """The fewest (then cheapest) model-stages to send over the durable route so an order exists.

    The all-live search gets ``budget`` branching states; the searches over subsets share another
    ``budget``; when that runs out every changed model-stage goes durable (always possible once plan
    B fits, checked before)."""
    changed = sorted(plans)
    everything = frozenset(changed)
    if allow_live:
        problem = _problem(moves, plans, caps, frozenset(), dtype_bytes)
        events, stuck, _ = find_order(problem, budget)
        if events is not None:
            waits = {after for _, after, kind in memory_edges(problem, events) if kind == "free"}
            why = f"{len(waits)} allocations wait for frees on their device" if waits else "no waits"
            return frozenset(), events, problem, f"live: every allocation fits in the chosen order ({why})"
        assert stuck is not None
        why, used = stuck.describe(), 0
        for subset in _subsets(changed, moves, stuck, dtype_bytes):
            if not stuck.forced <= subset:
                continue
            if used >= budget:
                why += "; the search budget ran out choosing which model-stages go durable"
                break
            problem = _problem(moves, plans, caps, subset, dtype_bytes)
            events, _, spent = find_order(problem, budget - used)
            used += spent
            if events is not None:
                return (
                    subset,
                    events,
                    problem,
                    f"mixed: {', '.join(sorted(subset))} durable, the rest live; {why}",
                )
        reason = f"durable: {why}"
    else:
        reason = "durable: the live route is disabled (allow_live=False)"
    problem = _problem(moves, plans, caps, everything, dtype_bytes)
    events, stuck, _ = find_order(problem, budget)
    if events is None:  # cannot happen once plan B fits every device (checked first)
        raise AssertionError(f"durable route found no order: {stuck.describe() if stuck else ''}")
    return everything, events, problem, reason


def _subsets(
    changed: list[str], moves: dict[str, StageMove], stuck: Deadlock, dtype_bytes: int | None
) -> list[frozenset[str]]:
    """Proper non-empty subsets of ``changed``: smallest first, then those touching a blocked device,
    then by bytes snapshotted."""
    blocked = stuck.devices
    size = {s: sum(moves[s].shard_bytes("old", dtype_bytes).values()) for s in changed}
    touches = {s for s in changed if blocked & (set(moves[s].old.devices) | set(moves[s].new.devices))}
    out = [frozenset(c) for k in range(1, len(changed)) for c in combinations(changed, k)]
    return sorted(out, key=lambda c: (len(c), not (c & touches), sum(size[s] for s in c), sorted(c)))


def _live_ops(
    move: StageMove, plan: ReshardPlan, problem: MemoryProblem, ops: list[Op], edges: list[Edge]
) -> None:
    s = move.stage
    ops += [Op("alloc", s, device=d, nbytes=problem.new[(s, d)]) for d in move.new.devices]
    count: dict[tuple[int, int, str], int] = defaultdict(int)
    for t in plan.transfers:
        i = count[(t.src, t.dst, t.name)]
        count[(t.src, t.dst, t.name)] += 1
        op = Op("transfer", s, src=t.src, dst=t.dst, tensor=t.name, region=t.region, index=i, nbytes=t.nbytes)
        ops.append(op)
        edges += [Edge("regroup", op.id, "data"), Edge(f"alloc:{s}:{t.dst}", op.id, "data")]
    for t in plan.local:
        i = count[(t.src, t.dst, t.name)]
        count[(t.src, t.dst, t.name)] += 1
        op = Op("copy", s, device=t.dst, tensor=t.name, region=t.region, index=i, nbytes=t.nbytes)
        ops.append(op)
        edges.append(Edge(f"alloc:{s}:{t.dst}", op.id, "data"))
    # Every old shard goes once the model-stage's new shards are complete: after all its pieces moved.
    moved = [op.id for op in ops if op.stage == s and op.kind in ("transfer", "copy")]
    ops += [Op("free", s, device=d, nbytes=problem.old[(s, d)]) for d in move.old.devices]
    edges += [Edge(x, f"free:{s}:{d}", "data") for d in move.old.devices for x in moved]


def _durable_ops(
    move: StageMove,
    maps: tuple[ShardMap, ShardMap],
    problem: MemoryProblem,
    ops: list[Op],
    edges: list[Edge],
    dtype_bytes: int | None,
) -> None:
    """Snapshot each distinct old box once, free every old shard after its snapshot, allocate and
    rehydrate every new shard once the whole snapshot is written."""
    s = move.stage
    old, _ = maps
    writers = write_assignment(old)
    written = {d: sum(b.numel * old.tensor(n).itemsize for n, b in boxes) for d, boxes in writers.items()}
    snaps = {d: Op("snapshot", s, device=d, nbytes=b) for d, b in written.items() if b}
    ops += list(snaps.values())
    ops += [Op("free", s, device=d, nbytes=problem.old[(s, d)]) for d in move.old.devices]
    edges += [Edge(op.id, f"free:{s}:{d}", "data") for d, op in snaps.items()]
    reads = move.state_bytes("new", dtype_bytes)
    for d in move.new.devices:
        alloc = Op("alloc", s, device=d, nbytes=problem.new[(s, d)])
        hydrate = Op("rehydrate", s, device=d, nbytes=reads[d])
        ops += [alloc, hydrate]
        edges.append(Edge(alloc.id, hydrate.id, "data"))
        # The store serves reads from a committed snapshot (engine/reshard.py): all of it first.
        edges += [Edge(snap.id, hydrate.id, "data") for snap in snaps.values()]


def write_assignment(smap: ShardMap) -> dict[int, list[tuple[str, Box]]]:
    """Which device snapshots which ``(name, box)``: one holder per distinct box, the one with the
    fewest bytes so far (ties: lowest device). Used by ``nereus_core.engine.reshard`` too
    (the durable executor), kept here so planning needs no engine."""
    load = dict.fromkeys(smap.layout.devices, 0)
    out: dict[int, list[tuple[str, Box]]] = {d: [] for d in smap.layout.devices}
    for spec in smap.tensors:
        holders: dict[Box, list[int]] = defaultdict(list)
        for piece in spec.pieces:
            holders[piece.box].append(piece.device)
        for box, devices in holders.items():
            writer = min(devices, key=lambda d: (load[d], d))
            load[writer] += box.numel * spec.itemsize
            out[writer].append((spec.name, box))
    return out


def _assemble(
    moves: dict[str, StageMove],
    ops: list[Op],
    edges: list[Edge],
    link: LinkModel,
    route: Route,
    reason: str,
    initial: dict[int, int],
    dtype_bytes: int | None,
) -> TransitionGraph:
    timing = schedule(ops, edges, link)
    by_id = {op.id: op for op in ops}
    peak, _, _ = replay_peaks(timing.waves, by_id, initial)
    on_path: dict[str, int] = defaultdict(int)
    for x in timing.critical_path:
        if by_id[x].link is not None:
            on_path[by_id[x].link] += by_id[x].nbytes  # type: ignore[index]
    order = {x: i for i, w in enumerate(timing.waves) for x in w}
    ops = sorted(ops, key=lambda op: order[op.id])
    return TransitionGraph(
        ops=tuple(ops),
        edges=(*edges, *timing.port_edges),
        waves=timing.waves,
        route=route,
        reason=reason,
        durable_stages=tuple(sorted(s for s, m in moves.items() if m.mode == "durable")),
        peak_bytes=peak,
        critical_path_s=timing.critical_path_s,
        critical_path=timing.critical_path,
        critical_link_bytes=dict(on_path),
        waves_s=timing.waves_s,
        start_s=timing.start,
        moves=moves,
        dtype_bytes=dtype_bytes,
    )
