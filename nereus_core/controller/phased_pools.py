"""Pools of one phase for the plan search: slot-disjoint pools, one per model-stage, sized to cost.

Boundary: given each model-stage's fastest seconds as a function of its pool's size (from its
candidate table), choose the pool sizes of one phase (the forward passes, or the train stages)
that minimise the phase's time (its slowest pool: ``plan.phases``' rule) within a region of
slots, and place them on consecutive slots. ``controller.search`` turns them into phased splits
and solves those like any other split; this module knows no cost formula.

Sizes come from one ladder (``ladder``): powers of two, and three times a power of two from two
nodes up, so a pool of a node or more starts on a node boundary when the larger pools are placed
first. The minimax is exact over the ladder: for each candidate phase time T (ascending), the
smallest pool of each stage that reaches T; the first T whose pools fit the region wins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

INF = float("inf")


def ladder(limit: int, per_node: int) -> list[int]:
    """Pool sizes up to ``limit``: powers of two, and 3 x 2^k from two nodes up, ascending."""
    sizes = {2**k for k in range(20)} | {3 * 2**k for k in range(20) if 3 * 2**k >= 2 * per_node}
    return sorted(v for v in sizes if v <= limit)


# Rest pools as multiples of generation's when generation has slots of its own.
REST_RATIOS = (0.5, 1.0, 1.5, 2.0, 3.0)


def regions(devices: int, per_node: int) -> list[tuple[int, int]]:
    """``(g, r)`` of every phased split on ``devices`` slots: generation on the first g slots and the
    other stages on the next r (g > 0), or everything on the first r (g = 0), g and r on the
    ladder (and r/g one of ``REST_RATIOS``). No pair depends on ``devices`` beyond fitting in it,
    so the splits of N slots are among those of N+1 (more slots never predict a slower step)."""
    sizes = ladder(devices, per_node)
    shared = [(0, r) for r in sizes]
    apart = [(g, r) for g in sizes for r in sizes if g + r <= devices and r / g in REST_RATIOS]
    return shared + apart


def fastest_by_size(world: np.ndarray, seconds: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """For each of ``sizes``, the fastest of ``seconds`` among candidates of at most that many slots
    (``world``); inf where none fits. Non-increasing in the size."""
    order = np.argsort(world, kind="stable")
    best = np.minimum.accumulate(seconds[order])
    count = np.searchsorted(world[order], np.asarray(sizes), side="right")
    return np.where(count > 0, best[np.maximum(count - 1, 0)], INF)


def split_phase(curves: Mapping[str, np.ndarray], sizes: Sequence[int], slots: int) -> dict[str, int] | None:
    """Pool size per stage (``curves[stage][i]``: its fastest seconds on ``sizes[i]`` slots) that
    minimises the slowest stage with the pools' sizes adding up to at most ``slots``; None if the
    stages cannot all get a pool."""
    finite = sorted({float(v) for c in curves.values() for v in c if np.isfinite(v)})
    sizes_arr = np.asarray(sizes)
    for target in finite:
        chosen = {}
        for stage, curve in curves.items():
            reach = np.flatnonzero(curve <= target)
            if not reach.size:
                break
            chosen[stage] = int(sizes_arr[reach[0]])
        if len(chosen) == len(curves) and sum(chosen.values()) <= slots:
            return chosen
    return None


def place(sizes: Mapping[str, int], first: int) -> dict[str, int]:
    """First slot of each stage's pool: consecutive from ``first``, larger pools first (ties in
    ``sizes`` order), so every pool of a node or more starts on a node boundary."""
    out, at = {}, first
    for stage in sorted(sizes, key=lambda s: -sizes[s]):
        out[stage] = at
        at += sizes[stage]
    return out


def memory_peak(intervals: Sequence[tuple[int, int, float, float]]) -> float:
    """Bytes on the busiest slot of stages on slots ``[start, stop)`` with resident and transient
    bytes: per slot the residents add up and the largest transient counts (``plan_estimate``'s rule)."""
    edges = sorted({e for start, stop, *_ in intervals for e in (start, stop)})
    peak = 0.0
    for at in edges[:-1]:
        on = [(r, t) for start, stop, r, t in intervals if start <= at < stop]
        if on:
            peak = max(peak, sum(r for r, _ in on) + max(t for _, t in on))
    return peak
