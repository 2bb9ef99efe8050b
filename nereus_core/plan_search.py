"""Search for the fastest memory-feasible global plans, without enumerating their cross product.

Boundary: given the devices, the usable memory per device, the workload, the
models and a (calibrated) cost model, return the best plan of every placement
and pool split, plus the fast plans that memory ruled out. The controller
(``controller.py``) decides whether switching to one of them pays.

How it stays fast (the brief asks for <= 50 ms at 1,024 devices x 6 model-stages):
1. Per model-stage, one vectorized table (``cost_terms.stage_tables``) of every
   candidate: tp a power of two within a node that shards the model, pp a power of
   two or divisor of the layers, dp a divisor of the batch, micro-batches a power of
   two dividing the replica batch; layouts use consecutive slots from the pool's
   first slot, so their links follow from the degrees (one table per node offset).
2. Pool splits: colocated (all slots, six stages) and, for disaggregated, generation
   on the first G slots and the other five stages on the rest, G on one ladder
   (powers of two, and 3 x 2^k from two nodes up) for every device count, so the
   candidates of N slots are among those of N+1 and more devices never predict a
   slower best step. The per-step weight sync (``cost_model.sync_seconds``) is folded
   into the generation seconds; colocated, it depends on actor/train's (t, p), so there
   is one colocated split per such pair. Splits are solved cheapest lower bound
   first and skipped once their bound cannot beat the best found.
3. In a pool, the stages couple only through memory: sum of resident state plus
   the largest transient (gradients, activations, KV) must fit. If every stage's
   fastest candidate fits together, that is optimal. Otherwise an exact knapsack over
   memory rounded *up* to 1/buckets of the budget (so any answer truly fits): for each
   cap T on the transient, a min-plus convolution over the stages' resident bytes
   under budget - T; caps are tried from high to low and stop once the stages'
   fastest candidates under the cap cannot beat the best found.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

import numpy as np

from nereus_core.config import ModelConfig
from nereus_core.cost_model import Scales, Workload
from nereus_core.cost_terms import PERSISTENT, contiguous_geometry, model_stats, split_arrays, stage_tables
from nereus_core.hardware import HardwareProfile
from nereus_core.layout import Layout
from nereus_core.plan import GENERATE, GlobalPlan, ModelStage, Placement, model_of, stage_rows
from nereus_core.transition_cost import sync_seconds

INF = float("inf")


@dataclass(frozen=True)
class SearchSpace:
    """What the search may use (fields of ``ControllerSettings``)."""

    devices: int
    budget: float  # usable bytes per device (capacity minus headroom)
    disaggregated: bool = True
    overlap: bool = True
    buckets: int = 64


@dataclass
class StageTable:
    """Every candidate layout of one model-stage from one first slot: degrees, seconds, bytes."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    m: np.ndarray
    seconds: np.ndarray
    persistent: np.ndarray
    transient: np.ndarray

    world: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.world = self.tp * self.pp * self.dp

    def layout(self, i: int, first: int) -> Layout:
        """Candidate ``i`` on consecutive slots from ``first``."""
        return _contiguous(int(self.tp[i]), int(self.pp[i]), int(self.dp[i]), first, int(self.m[i]))


@lru_cache(maxsize=4096)
def _contiguous(tp: int, pp: int, dp: int, first: int, m: int) -> Layout:
    """Valid by construction (degrees from a table, consecutive slots), so not re-checked."""
    devices = tuple(range(first, first + tp * pp * dp))
    return Layout.model_construct(tp=tp, pp=pp, dp=dp, devices=devices, micro_batches=m)


@dataclass
class PoolResult:
    """The best choice of one pool (candidate index per stage) and, when it differs because the
    fastest choices do not fit together, that fastest choice too."""

    choice: dict[str, int] | None
    seconds: float = INF
    memory: float = INF
    fastest: dict[str, int] | None = None
    reason: str = ""


Chosen = tuple[dict[str, StageTable], dict[str, int], int, int]  # tables, index per stage, first slot, size


@dataclass
class Found:
    """One global plan the search produced, with its search-time estimate (built lazily)."""

    placement: Placement
    parts: list[Chosen]
    seconds: float
    memory: float
    fits: bool

    @cached_property
    def plan(self) -> GlobalPlan:
        layouts = {
            s: tables[s].layout(i, first)
            for tables, choice, first, _ in self.parts
            for s, i in choice.items()
        }
        # Valid by construction (degrees from the tables, consecutive slots): not re-checked.
        # The job's stages in their canonical order, as the config's plans list them.
        order = [s for s in ModelStage if s in layouts]
        return GlobalPlan.model_construct(placement=self.placement, layouts={s: layouts[s] for s in order})


@dataclass
class SearchResult:
    feasible: list[Found] = field(default_factory=list)  # best per pool split, fastest first
    rejected: list[Found] = field(default_factory=list)  # faster plans memory ruled out
    variants: list[Found] = field(default_factory=list)  # the best with one stage's runner-up layout


def _powers(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def candidates(
    stage: str, model: ModelConfig, profile: HardwareProfile, work: Workload, max_world: int
) -> tuple[np.ndarray, ...]:
    """Arrays (tp, pp, dp, m) of the layouts considered for ``stage`` on up to ``max_world`` slots:
    the degrees ``plan.layout_problems`` admits (tp/pp shard the model, dp*m divides the stage's rows)."""
    batch = stage_rows(stage, work.batch, work.mini_batches)
    tps = [t for t in _powers(min(profile.devices_per_node, max_world)) if model.tp_error(t) is None]
    layers = model.num_hidden_layers
    pps = [p for p in range(1, min(layers, max_world) + 1) if (p & (p - 1) == 0 or layers % p == 0)]
    pps = [p for p in pps if model.pp_error(p) is None]
    dps = [d for d in range(1, min(batch, max_world) + 1) if batch % d == 0]
    waves = profile.max_generate_waves if stage == GENERATE else batch
    grid = np.array(np.meshgrid(tps, pps, dps, _powers(min(waves, batch)), indexing="ij")).reshape(4, -1)
    tp, pp, dp, m = grid
    keep = (tp * pp * dp <= max_world) & ((batch // dp) % m == 0)
    return tp[keep], pp[keep], dp[keep], m[keep]


def build_table(
    stage: str,
    model: ModelConfig,
    work: Workload,
    profile: HardwareProfile,
    scales: Scales,
    *,
    first: int,
    max_world: int,
    base: tuple[np.ndarray, ...] | None = None,
) -> StageTable:
    """Every candidate of ``stage`` placed from slot ``first``; ``base`` reuses the candidate
    degrees and their pipeline split (they do not depend on ``first``)."""
    stats = model_stats(model)
    if base is None:
        tp, pp, dp, m = candidates(stage, model, profile, work, max_world)
        base = (tp, pp, dp, m, *split_arrays(stats, tp, pp))
    tp, pp, dp, m, *split = base
    geo = contiguous_geometry(stats, profile, tp, pp, dp, m, first, split=tuple(split))
    raw, mem = stage_tables(stage.partition("/")[2], geo, work, stats, profile)  # type: ignore[arg-type]
    persistent, transient = mem[PERSISTENT].sum(axis=0), mem[~PERSISTENT].sum(axis=0)
    return StageTable(tp, pp, dp, m, scales.as_array() @ raw, persistent, transient)


def _masks(tables: dict[str, StageTable], size: int, budget: float) -> dict[str, np.ndarray]:
    """Candidates that fit the pool's slots and, alone, the memory budget."""
    return {s: (t.world <= size) & (t.persistent + t.transient <= budget) for s, t in tables.items()}


def lower_bound(tables: dict[str, StageTable], masks: dict[str, np.ndarray]) -> float:
    """Sum of each stage's fastest candidate, memory coupling ignored (no pool choice is faster)."""
    if not all(m.any() for m in masks.values()):
        return INF
    return sum(float(t.seconds[masks[s]].min()) for s, t in tables.items())


def solve_pool(tables: dict[str, StageTable], size: int, budget: float, buckets: int) -> PoolResult:
    """Fastest choice per stage with sum(resident) + max(transient) <= budget on ``size`` slots."""
    masks = _masks(tables, size, budget)
    empty = [s for s, mask in masks.items() if not mask.any()]
    if empty:
        return PoolResult(None, reason=f"{empty[0]}: no layout on {size} slots fits in memory alone")
    fastest = {s: int(np.argmin(np.where(masks[s], t.seconds, INF))) for s, t in tables.items()}
    seconds, memory = _totals(tables, fastest)
    if memory <= budget:
        return PoolResult(fastest, seconds, memory)
    best = _knapsack(tables, masks, budget, buckets)
    if best is None:
        return PoolResult(None, fastest=fastest, reason="the stages do not fit in memory together")
    return PoolResult(best, *_totals(tables, best), fastest=fastest)


def _totals(tables: dict[str, StageTable], choice: dict[str, int]) -> tuple[float, float]:
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


def _pools(devices: int, per_node: int, disaggregated: bool) -> list[tuple[Placement, int]]:
    """(placement, generation slots G) of every pool split; G = devices for colocated.

    G runs over one ladder for every device count: powers of two, and three times a
    power of two from two nodes up (so the rest pool starts on a node boundary).
    """
    out: list[tuple[Placement, int]] = [("colocated", devices)]
    if disaggregated:
        ladder = {2**k for k in range(16)} | {3 * 2**k for k in range(16) if 3 * 2**k >= 2 * per_node}
        out += [("disaggregated", g) for g in sorted(ladder) if g < devices]
    return out


Part = tuple[tuple[str, ...], int, int, dict[str, np.ndarray]]  # stages, first slot, size, seconds overrides


class Searcher:
    """Builds the stage tables once per call and answers pool by pool."""

    def __init__(
        self,
        space: SearchSpace,
        work: Workload,
        models: dict[str, ModelConfig],
        profile: HardwareProfile,
        scales: Scales,
        sync_scale: float = 1.0,
        *,
        stages: tuple[ModelStage, ...],
    ) -> None:
        self.space, self.work, self.models, self.profile, self.scales = space, work, models, profile, scales
        self.sync_scale, self.stages = sync_scale, stages
        self._tables: dict[tuple[str, int], StageTable] = {}
        self._bases: dict[str, tuple[np.ndarray, ...]] = {}

    def table(self, stage: str, first: int) -> StageTable:
        """Candidates of ``stage`` from slot ``first``: one table per node offset (links follow from it)."""
        key = (stage, first % self.profile.devices_per_node)
        if key not in self._tables:
            model = self.models[model_of(stage)]
            if stage not in self._bases:
                tp, pp, dp, m = candidates(stage, model, self.profile, self.work, self.space.devices)
                self._bases[stage] = (tp, pp, dp, m, *split_arrays(model_stats(model), tp, pp))
            self._tables[key] = build_table(
                stage,
                model,
                self.work,
                self.profile,
                self.scales,
                first=first,
                max_world=self.space.devices,
                base=self._bases[stage],
            )
        return self._tables[key]

    def tables(self, part: Part, *, bound: bool = False) -> dict[str, StageTable]:
        """The part's tables with its overrides; with ``bound``, node-aligned tables stand in when
        they cannot be slower (no shared cores: an offset only makes links slower)."""
        stages, first, _, overrides = part
        if bound and self.profile.cores_per_node is None:
            first = 0
        out = {s: self.table(s, first) for s in stages}
        return {s: replace(t, seconds=overrides[s]) if s in overrides else t for s, t in out.items()}

    def splits(self) -> list[tuple[Placement, list[Part]]]:
        """Every pool split with the weight sync folded into the stage seconds (see ``sync_seconds``)."""
        out: list[tuple[Placement, list[Part]]] = []
        rest = tuple(s for s in self.stages if s != GENERATE)
        gen, train = self.table(GENERATE, 0), self.table("actor/train", 0)
        actor, n = self.models["actor"], self.space.devices

        def sync(link: tuple[int, int], degrees: tuple[int, int] | None = None) -> np.ndarray:
            seconds = sync_seconds(actor, self.profile, gen.tp, gen.pp, link=link, train=degrees)
            return seconds * self.sync_scale

        # Colocated: the sync couples generate and train through train's (t, p); one split per pair.
        # Layouts start at slot 0: a training replica spans slots 0 .. t*p-1.
        pairs = np.unique(train.tp * 65536 + train.pp)
        for t, p in zip(pairs // 65536, pairs % 65536, strict=True):
            only = np.where((train.tp == t) & (train.pp == p), train.seconds, INF)
            seconds = {GENERATE: gen.seconds + sync((0, t * p - 1), (t, p)), "actor/train": only}
            parts = [(self.stages, 0, n, seconds)]
            out.append(("colocated", parts))
        if not self.space.disaggregated:
            return out
        for _, g in _pools(n, self.profile.devices_per_node, True)[1:]:
            parts = [((GENERATE,), 0, g, {GENERATE: gen.seconds + sync((0, g))}), (rest, g, n - g, {})]
            out.append(("disaggregated", parts))
        return out

    def run(self) -> SearchResult:
        """Solve every pool split, cheapest lower bound first, skipping splits that cannot win; then
        add runner-ups for the report: the best plan of the other placement and one-stage variants."""
        result = SearchResult()
        ranked = []
        for placement, parts in self.splits():
            bounds = [
                lower_bound(t, _masks(t, p[2], self.space.budget))
                for p in parts
                for t in [self.tables(p, bound=True)]
            ]
            overlap = placement == "disaggregated" and self.space.overlap
            ranked.append((max(bounds) if overlap else sum(bounds), placement, parts))
        ranked.sort(key=lambda item: item[0])
        best_seconds, seen = INF, set()
        for bound, placement, parts in ranked:
            if bound >= best_seconds and placement in seen:
                continue  # cannot beat the best found; the first of each placement is kept for the report
            if bound >= best_seconds and not np.isfinite(bound):
                continue
            seen.add(placement)
            best = self._solve(placement, parts, result)
            if best is not None:
                best_seconds = min(best_seconds, best.seconds)
        result.feasible.sort(key=lambda f: f.seconds)
        if result.feasible:
            result.variants = sorted(self._variants(result.feasible[0]), key=lambda f: f.seconds)
        result.rejected.sort(key=lambda f: f.seconds)
        return result

    def _solve(self, placement: Placement, parts: list[Part], result: SearchResult) -> Found | None:
        solved = []
        for part in parts:
            tables = self.tables(part)
            res = solve_pool(tables, part[2], self.space.budget, self.space.buckets)
            solved.append((res, tables, part[1], part[2]))
        best = self._found(placement, solved, fastest=False)
        if best is not None:
            result.feasible.append(best)
        if any(res.fastest is not None for res, *_ in solved):
            over = self._found(placement, solved, fastest=True)
            if over is not None and (best is None or over.seconds < best.seconds):
                result.rejected.append(over)
        return best

    def _found(self, placement: Placement, solved: list, *, fastest: bool) -> Found | None:
        """The plan made of each pool's best (or, with ``fastest``, its fastest) choice."""
        chosen: list[Chosen] = []
        for res, tables, first, size in solved:
            choice = (res.fastest or res.choice) if fastest else res.choice
            if choice is None:
                return None
            chosen.append((tables, choice, first, size))
        fits = all(choice is res.choice for (res, *_), (_, choice, *_) in zip(solved, chosen, strict=True))
        return self._total(placement, chosen, fits)

    def _total(self, placement: Placement, chosen: list[Chosen], fits: bool) -> Found:
        totals = [_totals(tables, choice) for tables, choice, _, _ in chosen]
        seconds = [t[0] for t in totals]
        overlap = placement == "disaggregated" and self.space.overlap
        total = max(seconds) if overlap else sum(seconds)
        return Found(placement, chosen, total, max(t[1] for t in totals), fits)

    def _variants(self, best: Found) -> list[Found]:
        """For each stage of ``best``, its next-fastest layout that still fits with the others."""
        out = []
        for k, (tables, choice, first, size) in enumerate(best.parts):
            masks = _masks(tables, size, self.space.budget)
            for stage, index in choice.items():
                seconds = np.where(masks[stage], tables[stage].seconds, INF)
                seconds[index] = INF
                for other in np.argsort(seconds)[:4]:
                    if not np.isfinite(seconds[other]):
                        break
                    alt = {**choice, stage: int(other)}
                    parts = [*best.parts[:k], (tables, alt, first, size), *best.parts[k + 1 :]]
                    found = self._total(best.placement, parts, True)
                    if found.memory <= self.space.budget:
                        out.append(found)
                        break
        return out
