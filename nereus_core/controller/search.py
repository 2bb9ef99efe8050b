"""Search for the fastest memory-feasible global plans, without enumerating their cross product.

Boundary: given the devices, the usable memory per device, the workload, the
models and a (calibrated) cost model, return the best plan of every placement
and pool split, plus the fast plans that memory ruled out. The controller
(``controller.py``) decides whether switching to one of them pays.

How it stays fast (the brief asks for <= 50 ms at 1,024 devices x 6 model-stages):
1. Per model-stage, one vectorized table (``cost.terms.stage_tables``) of every
   candidate: tp a power of two within a node that shards the model, pp a power of
   two or divisor of the layers, dp a divisor of the batch, micro-batches a power of
   two dividing the replica batch; layouts use consecutive slots from the pool's
   first slot, so their links follow from the degrees (one table per node offset).
2. Pool splits: colocated (all slots, six stages) and, for disaggregated, generation
   on the first G slots and the other five stages on the rest, G on one ladder
   (powers of two, and 3 x 2^k from two nodes up) for every device count, so the
   candidates of N slots are among those of N+1 and more devices never predict a
   slower best step. The per-step weight sync (``stage_cost.sync_seconds``) is folded
   into the generation seconds; colocated, it depends on actor/train's (t, p), so there
   is one colocated split per such pair. Splits are solved cheapest lower bound
   first and skipped once their bound cannot beat the best found.
3. In a pool, the stages couple only through memory; ``pool_solver`` picks the
   fastest candidates that fit together (an exact knapsack when the fastest do not).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from nereus_core.config import ModelConfig
from nereus_core.controller.pool_solver import INF, StageTable, fitting, lower_bound, solve_pool, totals
from nereus_core.cost.hardware import HardwareProfile
from nereus_core.cost.stage_cost import Scales, Workload
from nereus_core.cost.terms import PERSISTENT, contiguous_geometry, model_stats, split_arrays, stage_tables
from nereus_core.cost.transition_cost import sync_seconds
from nereus_core.plan import GENERATE, GlobalPlan, ModelStage, Placement, model_of, stage_rows


@dataclass(frozen=True)
class SearchSpace:
    """What the search may use (fields of ``ControllerSettings``)."""

    devices: int
    budget: float  # usable bytes per device (capacity minus headroom)
    disaggregated: bool = True
    overlap: bool = True
    buckets: int = 64


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
                lower_bound(t, fitting(t, p[2], self.space.budget))
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
        per_pool = [totals(tables, choice) for tables, choice, _, _ in chosen]
        seconds = [t[0] for t in per_pool]
        overlap = placement == "disaggregated" and self.space.overlap
        total = max(seconds) if overlap else sum(seconds)
        return Found(placement, chosen, total, max(t[1] for t in per_pool), fits)

    def _variants(self, best: Found) -> list[Found]:
        """For each stage of ``best``, its next-fastest layout that still fits with the others."""
        out = []
        for k, (tables, choice, first, size) in enumerate(best.parts):
            masks = fitting(tables, size, self.space.budget)
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
