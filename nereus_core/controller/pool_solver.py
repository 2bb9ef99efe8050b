"""One pool's exact choice: the fastest candidate layout per model-stage whose memory fits together.

Boundary: given each model-stage's table of candidates (degrees, seconds, resident and transient
bytes) and the pool's slots and usable memory per device, pick one candidate per stage. Which
tables a pool gets, and how pools combine into a global plan, is ``controller.search``'s business.

In a pool, the stages couple only through memory: sum of resident state plus the largest
transient (gradients, activations, KV) must fit. If every stage's fastest candidate fits
together, that is optimal. Otherwise an exact knapsack over memory rounded *up* to 1/buckets
of the budget (so any answer truly fits): for each cap T on the transient, a min-plus
convolution over the stages' resident bytes under budget - T; caps are tried from high to low
and stop once the stages' fastest candidates under the cap cannot beat the best found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from nereus_core.layout import Layout

INF = float("inf")


@dataclass
class StageTable:
    """Every candidate layout of one model-stage from one first slot: degrees, seconds, bytes."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    m: np.ndarray
    f1b: np.ndarray  # the candidate pipelines run 1F1B (``Layout.schedule``)
    rc: np.ndarray  # the candidate train stages recompute every layer (``Layout.recompute``)
    z3: np.ndarray  # the candidate train stages shard their state over dp (``Layout.shard`` full)
    seconds: np.ndarray
    persistent: np.ndarray
    transient: np.ndarray

    world: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.world = self.tp * self.pp * self.dp

    def layout(self, i: int, first: int) -> Layout:
        """Candidate ``i`` on consecutive slots from ``first``."""
        tp, pp, dp, m = (int(x[i]) for x in (self.tp, self.pp, self.dp, self.m))
        schedule = "1f1b" if self.f1b[i] else "gpipe"
        shard = "full" if self.z3[i] else "optimizer"
        return _contiguous(tp, pp, dp, first, m, schedule, bool(self.rc[i]), shard)


@lru_cache(maxsize=4096)
def _contiguous(
    tp: int, pp: int, dp: int, first: int, m: int, schedule: str, recompute: bool, shard: str
) -> Layout:
    """Valid by construction (degrees from a table, consecutive slots), so not re-checked."""
    devices = tuple(range(first, first + tp * pp * dp))
    return Layout.model_construct(
        tp=tp,
        pp=pp,
        dp=dp,
        devices=devices,
        micro_batches=m,
        schedule=schedule,
        recompute=recompute,
        shard=shard,
    )


@dataclass
class PoolResult:
    """The best choice of one pool (candidate index per stage) and, when it differs because the
    fastest choices do not fit together, that fastest choice too."""

    choice: dict[str, int] | None
    seconds: float = INF
    memory: float = INF
    fastest: dict[str, int] | None = None
    reason: str = ""


def fitting(tables: dict[str, StageTable], size: int, budget: float) -> dict[str, np.ndarray]:
    """Candidates that fit the pool's slots and, alone, the memory budget (a mask per stage)."""
    return {s: (t.world <= size) & (t.persistent + t.transient <= budget) for s, t in tables.items()}


def solve_pool(tables: dict[str, StageTable], size: int, budget: float, buckets: int) -> PoolResult:
    """Fastest choice per stage with sum(resident) + max(transient) <= budget on ``size`` slots."""
    masks = fitting(tables, size, budget)
    empty = [s for s, mask in masks.items() if not mask.any()]
    if empty:
        return PoolResult(None, reason=f"{empty[0]}: no layout on {size} slots fits in memory alone")
    fastest = {s: int(np.argmin(np.where(masks[s], t.seconds, INF))) for s, t in tables.items()}
    seconds, memory = totals(tables, fastest)
    if memory <= budget:
        return PoolResult(fastest, seconds, memory)
    best = _knapsack(tables, masks, budget, buckets)
    if best is None:
        return PoolResult(None, fastest=fastest, reason="the stages do not fit in memory together")
    return PoolResult(best, *totals(tables, best), fastest=fastest)


def totals(tables: dict[str, StageTable], choice: dict[str, int]) -> tuple[float, float]:
    """Seconds and per-device memory (resident plus the largest transient) of one choice per stage."""
    seconds = sum(float(tables[s].seconds[i]) for s, i in choice.items())
    resident = sum(float(tables[s].persistent[i]) for s, i in choice.items())
    return seconds, resident + max(float(tables[s].transient[i]) for s, i in choice.items())


def _knapsack(
    tables: dict[str, StageTable], masks: dict[str, np.ndarray], budget: float, buckets: int
) -> dict[str, int] | None:
    """Exact optimum over memory rounded up to budget/buckets (see the module docstring)."""
    unit = budget / buckets
    levels = {s: np.ceil(t.transient[masks[s]] / unit).astype(np.int64) for s, t in tables.items()}
    costs = {s: np.ceil(t.persistent[masks[s]] / unit).astype(np.int64) for s, t in tables.items()}
    grids = {}
    for s, t in tables.items():
        # grid[L, C]: fastest candidate with transient level <= L and resident buckets <= C
        grid = np.full((buckets + 1, buckets + 1), INF)
        np.minimum.at(grid, (levels[s], costs[s]), t.seconds[masks[s]])
        grids[s] = np.minimum.accumulate(np.minimum.accumulate(grid, axis=0), axis=1)
    caps = sorted({int(v) for lv in levels.values() for v in lv}, reverse=True)
    best: tuple[float, int, list[np.ndarray]] | None = None
    for cap in caps:
        bound = sum(float(g[cap, buckets]) for g in grids.values())
        if not np.isfinite(bound) or (best is not None and bound >= best[0]):
            break  # lower caps only remove candidates
        found = _min_plus([g[cap, : buckets - cap + 1] for g in grids.values()])
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], cap, found[1])
    if best is None:
        return None
    _, cap, used = best
    choice = {}
    for (s, t), c in zip(tables.items(), used, strict=True):
        ok = masks[s] & (np.ceil(t.transient / unit) <= cap) & (np.ceil(t.persistent / unit) <= c)
        choice[s] = int(np.argmin(np.where(ok, t.seconds, INF)))
    return choice


_SHIFT: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _shift(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Index ``b - j`` (clipped) and the mask ``j > b`` of a size x size min-plus grid."""
    if size not in _SHIFT:
        j = np.arange(size)
        _SHIFT[size] = (np.clip(j[:, None] - j[None, :], 0, None), j[None, :] > j[:, None])
    return _SHIFT[size]


def _min_plus(per_stage: list[np.ndarray]) -> tuple[float, list[int]] | None:
    """Min of sum_s per_stage[s][c_s] with sum_s c_s <= len - 1 (arrays non-increasing), and the c_s."""
    size = per_stage[0].shape[0]
    index, invalid = _shift(size)
    total = per_stage[0]
    splits = []
    for per in per_stage[1:]:
        grid = total[index] + per[None, :]  # grid[b, j]: j buckets to this stage, b - j before
        grid[invalid] = INF
        split = np.argmin(grid, axis=1)
        total = grid[np.arange(size), split]
        splits.append(split)
    if not np.isfinite(total[-1]):
        return None
    used, b = [], size - 1
    for split in reversed(splits):
        used.append(int(split[b]))
        b -= used[-1]
    used.append(b)
    return float(total[-1]), used[::-1]
