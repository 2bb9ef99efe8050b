"""The simulated world: the true time of every stage, weight sync and transition, and what fits in memory.

Boundary: the only place that knows the hidden truth. A stage's true time is the
analytic cost model's unscaled terms (``cost_terms.stage_tables``, the same
formulas ``cost_model.estimate`` uses) times a hidden factor per term; what a job
*measures* is that times seeded per-stage, per-step noise. Weight sync and
transitions take the hidden ``wire`` and ``ops`` factors of the transition cost.
Strategies see only measured times (``measured_stage_s``); the oracle helpers
(``true_scales``, ``tune``) are for the baselines, whose fixed configs are chosen
offline with perfect knowledge, in their favour.

The factors are drawn once per seed (log-normal, clipped), and the noise for every
(step, stage) up front, so every strategy of one (trace, seed) meets the same
hardware and the same noise (common random numbers: their differences are not luck).
Memory is not scaled: the cost model's memory is the truth (it gates feasibility).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from nereus_core.config import ModelConfig
from nereus_core.cost_model import Scales, TransitionEstimate, Workload, stage_kind, weight_sync_s
from nereus_core.cost_terms import PERSISTENT, TERMS, Geometry, layout_geometry, model_stats, stage_tables
from nereus_core.hardware import HardwareProfile
from nereus_core.layout import Layout
from nereus_core.plan import GENERATE, MODEL_STAGES, GlobalPlan, model_of, models_for
from nereus_core.sim.config import NoiseSettings
from nereus_core.sim.trace import Trace

SYNC = len(MODEL_STAGES)  # noise column of the weight sync


class StageEval(NamedTuple):
    """One model-stage on one layout for one workload: unscaled terms, true seconds, bytes per device."""

    raw: np.ndarray
    seconds: float
    persistent: float
    transient: float


class World:
    """One (trace, seed): the hidden factors, the noise, and the true cost of anything a strategy runs."""

    def __init__(
        self, trace: Trace, model: ModelConfig, profile: HardwareProfile, noise: NoiseSettings, seed: int
    ) -> None:
        self.trace, self.profile, self.seed = trace, profile, seed
        self.models = models_for(model)
        rng = np.random.default_rng([seed, 20_260_117])
        hidden = np.exp(rng.normal(0.0, noise.hidden_sigma, size=len(TERMS) + 2))
        hidden = np.clip(hidden, 1.0 / noise.hidden_max, noise.hidden_max)
        self.factors = hidden[: len(TERMS)]
        self.wire, self.ops = float(hidden[-2]), float(hidden[-1])
        self.stage_noise = np.exp(rng.normal(0.0, noise.stage_sigma, size=(trace.steps, SYNC + 1)))
        self.transition_noise = np.exp(rng.normal(0.0, noise.transition_sigma, size=trace.steps))
        self._recompute = profile.model_copy(update={"activation_recompute": "full"})
        self._geometries: dict[tuple, Geometry] = {}
        self._evals: dict[tuple, StageEval] = {}

    @property
    def steps(self) -> int:
        return self.trace.steps

    def true_scales(self) -> Scales:
        """The hidden factors as cost-model scales (oracle knowledge)."""
        return Scales.from_array(self.factors)

    # ---------------------------------------------------------------- time

    def _geometry(self, stage: str, layout: Layout) -> Geometry:
        key = (model_of(stage), layout.tp, layout.pp, layout.dp, layout.micro_batches, layout.devices)
        geo = self._geometries.get(key)
        if geo is None:
            stats = model_stats(self.models[model_of(stage)])
            geo = self._geometries[key] = layout_geometry(stats, self.profile, layout)
        return geo

    def tables(
        self, stage: str, geo: Geometry, work: Workload, profile: HardwareProfile | None = None
    ) -> tuple[np.ndarray, ...]:
        """Unscaled terms ``[terms, n]``, true seconds, persistent and transient bytes per candidate."""
        stats = model_stats(self.models[model_of(stage)])
        raw, mem = stage_tables(stage_kind(stage), geo, work, stats, profile or self.profile)
        return raw, self.factors @ raw, mem[PERSISTENT].sum(axis=0), mem[~PERSISTENT].sum(axis=0)

    def stage(self, stage: str, layout: Layout, work: Workload) -> StageEval:
        """One model-stage on one layout for one workload (kept for the step, as strategies ask twice)."""
        key = (stage, layout.tp, layout.pp, layout.dp, layout.micro_batches, layout.devices, work)
        found = self._evals.get(key)
        if found is None:
            raw, secs, persistent, transient = self.tables(stage, self._geometry(stage, layout), work)
            found = self._evals[key] = StageEval(
                raw[:, 0], float(secs[0]), float(persistent[0]), float(transient[0])
            )
        return found

    def begin_step(self) -> None:
        """Forget the stage evaluations of earlier steps (each step has its own workload)."""
        self._evals.clear()

    def true_stage_s(self, stage: str, layout: Layout, work: Workload) -> float:
        return self.stage(stage, layout, work).seconds

    def measured_stage_s(self, k: int, stage: str, true_s: float) -> float:
        return true_s * float(self.stage_noise[k, MODEL_STAGES.index(stage)])

    def raw_sync_s(self, plan: GlobalPlan) -> float:
        """Weight sync from actor/train to actor/generate as the cost model estimates it (unscaled)."""
        train, gen = plan.layouts.get("actor/train"), plan.layouts.get(GENERATE)
        if train is None or gen is None:
            return 0.0
        colocated = plan.placement == "colocated"
        return weight_sync_s(train, gen, self.models["actor"], self.profile, colocated=colocated)

    def true_sync_s(self, plan: GlobalPlan) -> float:
        """The weight sync in truth: the estimate x the hidden wire factor."""
        return self.raw_sync_s(plan) * self.wire

    def measured_sync_s(self, k: int, true_s: float) -> float:
        return true_s * float(self.stage_noise[k, SYNC])

    def transition_s(self, k: int, estimate: TransitionEstimate) -> float:
        """What a transition the cost model estimated (its unscaled parts) takes in this world."""
        return (self.wire * estimate.wire_s + self.ops * estimate.ops_s) * float(self.transition_noise[k])

    # ---------------------------------------------------------------- memory and micro-batches

    def resident(self, plan: GlobalPlan, work: Workload) -> dict[str, float]:
        """Per model-stage: the persistent bytes (weights, optimizer) of its busiest device, summed over
        every stage on that device; memory per device is that plus the largest transient."""
        per_stage = {s: self.stage(s, v, work).persistent for s, v in plan.layouts.items()}
        top = max(max(layout.devices) for layout in plan.layouts.values()) + 1
        on_device = np.zeros(top)
        for stage, layout in plan.layouts.items():
            on_device[np.asarray(layout.devices)] += per_stage[stage]
        return {s: float(on_device[np.asarray(v.devices)].max()) for s, v in plan.layouts.items()}

    def tune(
        self, plan: GlobalPlan, work: Workload, usable: float
    ) -> tuple[GlobalPlan, bool, dict[str, float]]:
        """The plan with each stage's micro-batch count (generation: waves) that runs fastest in truth
        while every device fits ``usable`` bytes; the degrees and devices stay. Returns the plan, whether
        it fits, and each stage's true seconds. When nothing fits, the least-memory choice is kept.

        Memory per device = resident + the largest transient of its stages, so a stage fits iff its
        transient <= usable - the resident bytes of its busiest device: stages choose independently.
        A train stage that fits with no micro-batch count turns on full activation recomputation
        (gradient checkpointing, on by default in verl's and OpenRLHF's examples) at its time cost.
        """
        resident = self.resident(plan, work)
        layouts, fits, seconds = {}, True, {}
        for stage, layout in plan.layouts.items():
            ms = micro_batch_options(stage, layout, work.batch, self.profile)
            one = self._geometry(stage, layout)
            geo = Geometry(*(np.repeat(f, len(ms)) for f in one))._replace(m=np.asarray(ms, dtype=np.int64))
            raw, secs, persistent, transient = self.tables(stage, geo, work)
            ok = transient <= usable - resident[stage]
            if not ok.any() and stage_kind(stage) == "train" and self.profile.activation_recompute != "full":
                raw, secs, persistent, transient = self.tables(stage, geo, work, self._recompute)
                ok = transient <= usable - resident[stage]
            if ok.any():
                i = int(np.argmin(np.where(ok, secs, np.inf)))
            else:
                i, fits = int(np.argmin(transient)), False
            layouts[stage] = chosen = layout.model_copy(update={"micro_batches": ms[i]})
            seconds[stage] = float(secs[i])
            key = (stage, chosen.tp, chosen.pp, chosen.dp, chosen.micro_batches, chosen.devices, work)
            self._evals[key] = StageEval(raw[:, i], float(secs[i]), float(persistent[i]), float(transient[i]))
        return GlobalPlan.model_construct(placement=plan.placement, layouts=layouts), fits, seconds

    def peak_bytes(self, plan: GlobalPlan, work: Workload) -> float:
        """Bytes on the busiest device of ``plan`` (``plan.evaluate_plan``'s rule, true memory)."""
        resident = self.resident(plan, work)
        return max(resident[s] + self.stage(s, v, work).transient for s, v in plan.layouts.items())


def micro_batch_options(stage: str, layout: Layout, batch: int, profile: HardwareProfile) -> list[int]:
    """Micro-batch counts (waves for generation) that split a replica's batch evenly: powers of two."""
    per_replica = batch // layout.dp
    cap = min(per_replica, profile.max_generate_waves) if stage == GENERATE else per_replica
    out, m = [], 1
    while m <= cap:
        if per_replica % m == 0:
            out.append(m)
        m *= 2
    return out or [1]


def largest_dp(batch: int, slots: int) -> int:
    """The largest data-parallel degree <= ``slots`` that divides ``batch``."""
    for d in range(max(1, slots), 0, -1):
        if batch % d == 0:
            return d
    return 1


def usable_bytes(capacity: float, headroom: float) -> float:
    return math.floor(capacity * (1.0 - headroom))
