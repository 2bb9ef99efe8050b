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
2. Pool splits: colocated (all slots, six stages); disaggregated, generation on the first G
   slots and the other five stages on the rest, G on one ladder (``phased_pools.ladder``) for
   every device count, so the candidates of N slots are among those of N+1 and more devices
   never predict a slower best step; and phased, generation on all slots or the first G, the
   forward passes on slot-disjoint pools of the rest and the train stages likewise, pools sized
   to the stages' cost (``phased_pools``). The per-step weight sync
   (``stage_cost.sync_seconds``) is folded into the generation seconds; colocated, it depends
   on actor/train's (t, p), so there is one colocated split per such pair. Splits are solved
   cheapest lower bound first and skipped once their bound cannot beat the best found; every
   split's step time is the one step-time rule (``plan_estimate.step_seconds``).
3. In a pool, the stages couple only through memory; ``pool_solver`` picks the
   fastest candidates that fit together (an exact knapsack when the fastest do not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

import numpy as np

from nereus_core.config import ModelConfig, Workload
from nereus_core.controller import phased_pools
from nereus_core.controller.candidates import build_table, candidates
from nereus_core.controller.pool_solver import INF, StageTable, fitting, solve_pool, totals
from nereus_core.cost.hardware import HardwareProfile
from nereus_core.cost.plan_estimate import step_seconds
from nereus_core.cost.stage_cost import Scales
from nereus_core.cost.terms import model_stats, split_arrays
from nereus_core.cost.transition_cost import sync_seconds
from nereus_core.layout import Layout
from nereus_core.plan import GENERATE, GlobalPlan, ModelStage, Placement, model_of


@dataclass(frozen=True)
class SearchSpace:
    """What the search may use (fields of ``ControllerSettings``)."""

    devices: int
    budget: float  # usable bytes per device (capacity minus headroom)
    disaggregated: bool = True
    phased: bool = True  # phased splits: the forward passes, and the train stages, on pools of their own
    overlap: bool = True
    buckets: int = 64
    pipelined_generation: bool = True  # False: generation on pp=1 only (vLLM engines)


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


def _pools(devices: int, per_node: int, disaggregated: bool) -> list[tuple[Placement, int]]:
    """(placement, generation slots G) of every pool split; G = devices for colocated.

    G runs over one ladder for every device count (``phased_pools.ladder``: powers of two, and
    three times a power of two from two nodes up, so the rest pool starts on a node boundary).
    """
    out: list[tuple[Placement, int]] = [("colocated", devices)]
    if disaggregated:
        out += [("disaggregated", g) for g in phased_pools.ladder(devices - 1, per_node)]
    return out


Part = tuple[tuple[str, ...], int, int, dict[str, np.ndarray]]  # stages, first slot, size, seconds overrides


@lru_cache(maxsize=1024)
def _region(first: int, size: int) -> Layout:
    """The slots of a pool as a layout (for the step-time rule's pools; degrees irrelevant)."""
    return Layout.model_construct(
        tp=1, pp=1, dp=size, devices=tuple(range(first, first + size)), micro_batches=1
    )


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
                arrays = candidates(stage, model, self.profile, self.work, self.space.devices)
                if stage == GENERATE and not self.space.pipelined_generation:
                    arrays = tuple(a[arrays[1] == 1] for a in arrays)
                tp, pp = arrays[0], arrays[1]
                self._bases[stage] = (*arrays, *split_arrays(model_stats(model), tp, pp))
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
        apart = [g for _, g in _pools(n, self.profile.devices_per_node, self.space.disaggregated)[1:]]
        for g in apart:
            parts = [((GENERATE,), 0, g, {GENERATE: gen.seconds + sync((0, g))}), (rest, g, n - g, {})]
            out.append(("disaggregated", parts))
        if self.space.phased:
            regions = phased_pools.regions(n, self.profile.devices_per_node)
            out += [("phased", parts) for g, r in regions if (parts := self._phased(g, r, sync)) is not None]
        return out

    def _phased(self, g: int, r: int, sync: Callable[..., np.ndarray]) -> list[Part] | None:
        """The phased split of region ``(g, r)`` (``phased_pools.regions``): generation on slots
        0..r-1 with the rest on the same slots (g = 0), or on 0..g-1 with the rest on g..g+r-1; the
        forward passes on pools of their own in the rest, and the train stages likewise; None when
        neither phase has two stages to run at once. Stages whose pools coincide are solved together
        (one pool); pools that overlap are checked together after."""
        first = g
        sizes = phased_pools.ladder(r, self.profile.devices_per_node)
        regions: dict[str, tuple[int, int]] = {}
        split_any = False
        for kind in ("infer", "train"):
            stages = [s for s in self.stages if s.kind == kind]
            split = self._split(stages, sizes, r) if len(stages) > 1 else None
            split_any |= split is not None
            placed = phased_pools.place(split, first) if split else {}
            regions |= {s: (placed[s], split[s]) if split else (first, r) for s in stages}
        if not split_any:
            return None
        gen = self.table(GENERATE, 0)
        train_first, train_size = regions["actor/train"]
        if g == 0 and train_size == r:  # the colocated reshard, at train's fastest (t, p)
            t = self.table("actor/train", 0)
            i = int(np.argmin(np.where(t.world <= r, t.seconds, INF)))
            synced = gen.seconds + sync((0, int(t.tp[i] * t.pp[i]) - 1), (int(t.tp[i]), int(t.pp[i])))
        else:
            synced = gen.seconds + sync((0, train_first))
        regions[GENERATE] = (0, g or r)
        grouped: dict[tuple[int, int], list[str]] = {}
        for stage in self.stages:
            grouped.setdefault(regions[stage], []).append(stage)
        return [
            (tuple(stages), at, width, {GENERATE: synced} if GENERATE in stages else {})
            for (at, width), stages in grouped.items()
        ]

    def _split(self, stages: list[ModelStage], sizes: list[int], slots: int) -> dict[str, int] | None:
        """Pool sizes of one phase's ``stages`` (``phased_pools.split_phase``), each stage's seconds
        by pool size from its node-aligned table (candidates that fit in memory alone)."""
        curves = {}
        for stage in stages:
            t = self.table(stage, 0)
            alone = np.where(t.persistent + t.transient <= self.space.budget, t.seconds, INF)
            curves[stage] = phased_pools.fastest_by_size(t.world, alone, sizes)
        return phased_pools.split_phase(curves, sizes, slots)

    def run(self) -> SearchResult:
        """Solve every pool split, cheapest lower bound first, skipping splits that cannot win; then
        add runner-ups for the report: the best plan of the other placement and one-stage variants."""
        result = SearchResult()
        ranked = []
        for placement, parts in self.splits():
            ranked.append((self._bound(parts), placement, parts))
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

    def _bound(self, parts: list[Part]) -> float:
        """No plan of the split is faster: each stage's fastest candidate that fits its pool alone,
        combined by the step-time rule over the pools' slots (memory coupling ignored)."""
        seconds, regions = {}, {}
        for part in parts:
            tables = self.tables(part, bound=True)
            masks = fitting(tables, part[2], self.space.budget)
            for s, t in tables.items():
                seconds[s] = float(t.seconds[masks[s]].min()) if masks[s].any() else INF
                regions[s] = _region(part[1], part[2])
        return step_seconds(regions, seconds, 0.0, overlap=self.space.overlap)

    def _solve(self, placement: Placement, parts: list[Part], result: SearchResult) -> Found | None:
        solved = []
        for part in parts:
            tables = self.tables(part)
            res = solve_pool(tables, part[2], self.space.budget, self.space.buckets)
            solved.append((res, tables, part[1], part[2]))
        if placement == "phased":
            return self._solve_phased(parts, solved, result)
        best = self._found(placement, solved, fastest=False)
        if best is not None:
            result.feasible.append(best)
        if any(res.fastest is not None for res, *_ in solved):
            over = self._found(placement, solved, fastest=True)
            if over is not None and (best is None or over.seconds < best.seconds):
                result.rejected.append(over)
        return best

    def _solve_phased(self, parts: list[Part], solved: list, result: SearchResult) -> Found | None:
        """Each pool's own choice when they fit together where pools overlap; else one knapsack over
        every stage, each within its pool (residents counted on every slot: what it picks fits)."""
        own = self._found("phased", solved, fastest=False)
        if own is not None and own.fits and np.isfinite(own.seconds):
            result.feasible.append(own)
            return own
        tables = {}
        for part in parts:
            for s, t in self.tables(part).items():
                tables[s] = replace(t, seconds=np.where(t.world <= part[2], t.seconds, INF))
        joint = solve_pool(tables, self.space.devices, self.space.budget, self.space.buckets)
        if joint.choice is None:
            return None
        chosen = [(self.tables(p), {s: joint.choice[s] for s in p[0]}, p[1], p[2]) for p in parts]
        found = self._total("phased", chosen, True)
        if not np.isfinite(found.seconds):
            return None
        result.feasible.append(found)
        if own is not None and own.seconds < found.seconds:
            result.rejected.append(own)
        return found

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
        """The step-time rule over the chosen layouts; memory per pool, and where pools overlap
        (phased) per slot over them all."""
        seconds = {
            s: float(tables[s].seconds[i]) for tables, choice, _, _ in chosen for s, i in choice.items()
        }
        layouts = {
            s: tables[s].layout(i, first) for tables, choice, first, _ in chosen for s, i in choice.items()
        }
        total = step_seconds(layouts, seconds, 0.0, overlap=self.space.overlap)
        if placement == "phased":
            memory = phased_pools.memory_peak(
                [
                    (
                        first,
                        first + int(tables[s].world[i]),
                        float(tables[s].persistent[i]),
                        float(tables[s].transient[i]),
                    )
                    for tables, choice, first, _ in chosen
                    for s, i in choice.items()
                ]
            )
            fits = fits and memory <= self.space.budget
        else:
            memory = max(totals(tables, choice)[1] for tables, choice, _, _ in chosen)
        return Found(placement, chosen, total, memory, fits)

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
