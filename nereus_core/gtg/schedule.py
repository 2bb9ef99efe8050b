"""Timing a transition DAG: a port-aware list schedule, its waves and its critical path.

List scheduling (Graham 1969) over the DAG of data and memory edges: an op is ready when its
predecessors are done and starts as soon as every port it uses (``Op.ports``) is free; among
ready ops the one with the longest remaining chain of durations goes first (highest level first,
as in HLFET). Transfers of one model-stage between one pair of devices are scheduled as one unit
(they share both ports and all neighbours; members run back to back). The order each port serves
its ops becomes ``port`` edges, so the longest path of
the augmented DAG equals the simulated makespan: it is the critical path, and it accounts for
transfers that queue behind each other on a shared device. Waves are the levels of the
augmented DAG (ops whose longest chain of edges from a source has the same length): no two ops
of a wave share a port or depend on each other.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise

from nereus_core.gtg.ops import Edge, LinkModel, Op, Port


@dataclass(frozen=True)
class Timing:
    start: dict[str, float]
    duration: dict[str, float]
    port_edges: tuple[Edge, ...]
    waves: tuple[tuple[str, ...], ...]
    critical_path: tuple[str, ...]
    critical_path_s: float
    waves_s: float


def topological(ids: list[str], preds: dict[str, list[str]], succs: dict[str, list[str]]) -> list[str]:
    """Kahn's order (ties in ``ids`` order); raises ValueError naming ops on a cycle."""
    rank = {x: i for i, x in enumerate(ids)}
    indeg = {x: len(preds[x]) for x in ids}
    heap = [(rank[x], x) for x in ids if indeg[x] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, x = heapq.heappop(heap)
        order.append(x)
        for y in succs[x]:
            indeg[y] -= 1
            if indeg[y] == 0:
                heapq.heappush(heap, (rank[y], y))
    if len(order) != len(ids):
        stuck = [x for x in ids if indeg[x] > 0]
        raise ValueError(f"the transition graph has a dependency cycle through {stuck[:5]}")
    return order


def _adjacency(ids: list[str], edges: list[Edge]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    preds: dict[str, list[str]] = {x: [] for x in ids}
    succs: dict[str, list[str]] = {x: [] for x in ids}
    for e in edges:
        preds[e.after].append(e.before)
        succs[e.before].append(e.after)
    return preds, succs


def _list_schedule(
    ports: dict[str, tuple[Port, ...]],
    dur: dict[str, float],
    preds: dict[str, list[str]],
    succs: dict[str, list[str]],
    order: list[str],
) -> dict[Port, list[str]]:
    """Each port's units in the order a list schedule serves them (see the module doc)."""
    level: dict[str, float] = {}
    for x in reversed(order):
        level[x] = dur[x] + max((level[y] for y in succs[x]), default=0.0)
    rank = {x: i for i, x in enumerate(order)}

    def key(x: str) -> tuple[float, int]:
        return (-level[x], rank[x])

    indeg = {x: len(preds[x]) for x in order}
    busy: set[Port] = set()
    queues: dict[Port, list[tuple[tuple[float, int], str]]] = defaultdict(list)
    served: dict[Port, list[str]] = defaultdict(list)
    running: list[tuple[float, int, str]] = []
    trial: list[tuple[tuple[float, int], str, Port | None]] = [
        (key(x), x, None) for x in order if not indeg[x]
    ]
    heapq.heapify(trial)
    now = 0.0
    while True:
        while trial:
            k, x, origin = heapq.heappop(trial)
            blocked = next((p for p in ports[x] if p in busy), None)
            if blocked is None:
                for p in ports[x]:
                    busy.add(p)
                    served[p].append(x)
                heapq.heappush(running, (now + dur[x], rank[x], x))
                continue
            heapq.heappush(queues[blocked], (k, x))
            if origin is not None and origin not in busy and queues[origin]:
                k2, y = heapq.heappop(queues[origin])
                heapq.heappush(trial, (k2, y, origin))
        if not running:
            return served
        now = running[0][0]
        while running and running[0][0] <= now:
            _, _, x = heapq.heappop(running)
            for p in ports[x]:
                busy.discard(p)
                if queues[p]:
                    k2, y = heapq.heappop(queues[p])
                    heapq.heappush(trial, (k2, y, p))
            for y in succs[x]:
                indeg[y] -= 1
                if not indeg[y]:
                    heapq.heappush(trial, (key(y), y, None))


def _units(ops: list[Op]) -> dict[str, list[str]]:
    """Transfers (copies) of one model-stage between one pair of devices share ports and neighbours:
    they are scheduled as one unit whose members run back to back (far fewer units to schedule)."""
    units: dict[str, list[str]] = defaultdict(list)
    for op in ops:
        bundle = op.kind in ("transfer", "copy")
        units[f"{op.kind}:{op.stage}:{op.src}:{op.dst}:{op.device}" if bundle else op.id].append(op.id)
    return units


def _port_order(ops: list[Op], edges: list[Edge], dur: dict[str, float]) -> list[Edge]:
    """``port`` edges: the service order of every port, from a list schedule of units."""
    by_id = {op.id: op for op in ops}
    units = _units(ops)
    unit_of = {x: u for u, members in units.items() for x in members}
    names = list(units)
    preds: dict[str, set[str]] = {u: set() for u in names}
    succs: dict[str, set[str]] = {u: set() for u in names}
    for e in edges:
        a, b = unit_of[e.before], unit_of[e.after]
        if a != b:
            preds[b].add(a)
            succs[a].add(b)
    p_list = {u: sorted(v) for u, v in preds.items()}
    s_list = {u: sorted(v) for u, v in succs.items()}
    order = topological(names, p_list, s_list)
    unit_dur = {u: sum(dur[x] for x in members) for u, members in units.items()}
    served = _list_schedule(
        {u: by_id[members[0]].ports for u, members in units.items()}, unit_dur, p_list, s_list, order
    )
    have = {(e.before, e.after) for e in edges}
    out: list[Edge] = []

    def add(a: str, b: str) -> None:
        if (a, b) not in have:
            have.add((a, b))
            out.append(Edge(a, b, "port"))

    for members in units.values():
        for a, b in pairwise(members):
            add(a, b)
    for port in sorted(served):
        for u, v in pairwise(served[port]):
            add(units[u][-1], units[v][0])
    return out


def schedule(ops: list[Op], edges: list[Edge], link: LinkModel) -> Timing:
    """Time ``ops`` under ``edges``: port order, waves and the critical path (see the module doc)."""
    ids = [op.id for op in ops]
    dur = {op.id: link.duration(op) for op in ops}
    port_edges = _port_order(ops, edges, dur)
    preds, succs = _adjacency(ids, [*edges, *port_edges])
    order = topological(ids, preds, succs)
    end: dict[str, float] = {}
    via: dict[str, str | None] = {}
    level: dict[str, int] = {}
    for x in order:
        first = max(preds[x], key=lambda p: end[p], default=None)
        end[x] = (end[first] if first else 0.0) + dur[x]
        via[x] = first
        level[x] = 1 + max((level[p] for p in preds[x]), default=-1)
    last = max(ids, key=lambda x: end[x], default=None)
    path: list[str] = []
    while last is not None:
        path.append(last)
        last = via[last]
    waves: dict[int, list[str]] = defaultdict(list)
    for x in ids:
        waves[level[x]].append(x)
    wave_list = tuple(tuple(waves[i]) for i in sorted(waves))
    return Timing(
        start={x: end[x] - dur[x] for x in ids},
        duration=dur,
        port_edges=tuple(port_edges),
        waves=wave_list,
        critical_path=tuple(reversed(path)),
        critical_path_s=max(end.values(), default=0.0),
        waves_s=sum(max(dur[x] for x in w) for w in wave_list),
    )
