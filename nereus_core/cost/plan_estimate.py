"""Plan-level sums: a global plan's step time and memory per device from its stages' estimates.

Boundary: how the per-stage numbers of ``stage_cost.py`` add up for one plan
(``plan.py`` says what a plan is; the controller says which plan to run).

- A step is its phases (``plan.phases``) one after another; a phase takes its slowest pool's
  time, stages sharing slots adding up (``step_seconds``, the one rule the job's report,
  ``nereus plan``, the controller and the simulator use). Colocated, that is the sum of the
  stage times (verl's default); phased, the forward passes (and the train stages) on disjoint
  pools run at once (as OpenRLHF runs its Ray actor groups).
- Generation on slots of its own: with ``overlap`` the generation of step k+1 runs while the
  rest of step k trains (one-step off-policy, as OpenRLHF's async mode and verl's
  fully_async), so a step takes the longer of the two (generation waits for the weight
  sync); without it the pools take turns and idle (OpenRLHF's default).
  Either way the actor's new weights go to the generation copy every step
  (``stage_cost.weight_sync_s``).

Memory per device: state that stays between stages (weights, optimizer state)
of every model-stage on the device adds up; gradients, activations and KV caches
live only while their stage runs, so the largest of them counts.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from nereus_core.config import ModelConfig, Workload
from nereus_core.cost.hardware import HardwareProfile
from nereus_core.cost.stage_cost import Estimate, MemoryEstimate, Scales, estimate_many
from nereus_core.cost.terms import slots
from nereus_core.cost.transition_cost import weight_sync_s
from nereus_core.layout import Layout
from nereus_core.plan import (
    GENERATE,
    GlobalPlan,
    StageLayouts,
    generation_apart,
    model_of,
    phases,
    sync_colocated,
)


def memory_per_device(plan: GlobalPlan, memory: Mapping[str, MemoryEstimate]) -> dict[int, int]:
    """Bytes each slot needs: the sum of resident state of its model-stages + the largest transient.

    ``memory[stage]`` is the stage's busiest device, used for every device of its
    layout (an upper bound where pipeline stages differ).
    """
    persistent: dict[int, int] = {}
    transient: dict[int, int] = {}
    for stage, layout in plan.layouts.items():
        mem = memory[stage]
        for d in layout.devices:
            persistent[d] = persistent.get(d, 0) + mem.persistent
            transient[d] = max(transient.get(d, 0), mem.transient)
    return {d: persistent[d] + transient[d] for d in persistent}


def phase_seconds(layouts: StageLayouts, stage_seconds: Mapping[str, float]) -> dict[str, float]:
    """Each phase's time (``plan.phases`` order): its slowest pool's, a pool's stages adding up."""
    return {
        kind: max(sum(stage_seconds.get(s, 0.0) for s in pool) for pool in pools)
        for kind, pools in phases(layouts).items()
    }


def step_seconds(
    layouts: StageLayouts, stage_seconds: Mapping[str, float], sync_s: float, *, overlap: bool
) -> float:
    """Predicted (or measured) step time of a plan from its stage times: the one step-time rule.

    A step is its phases one after another (``plan.phases``: generation, the forward passes, the
    train stages); a phase takes its slowest pool's time, the stages of one pool adding up; the
    weight sync comes after generation's phase. With ``overlap`` and generation on slots of its
    own (``plan.generation_apart``), generation of the next step runs while the rest trains, so a
    step takes the longer of the two (the new weights land before generating)."""
    per_phase = phase_seconds(layouts, stage_seconds)
    generation = per_phase.pop("generate", 0.0) + sync_s
    rest = sum(per_phase.values())
    if overlap and generation_apart(layouts):
        return max(generation, rest)
    return generation + rest


class PlanEstimate(BaseModel):
    """A plan with its per-stage estimates, step time and busiest device's memory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan: GlobalPlan
    stages: dict[str, Estimate]
    sync_s: float = Field(description="Weight sync from actor/train to actor/generate, per step.")
    step_s: float
    memory_peak: int = Field(description="Bytes on the busiest slot.")
    usable: int = Field(description="Usable bytes per slot (capacity minus headroom).")

    @property
    def fits(self) -> bool:
        return self.memory_peak <= self.usable


def evaluate_plan(
    plan: GlobalPlan,
    workload: Workload,
    *,
    models: Mapping[str, ModelConfig],
    profile: HardwareProfile,
    scales: Scales,
    sync_scale: float,
    overlap: bool,
    usable: int,
    cache: dict | None = None,
) -> PlanEstimate:
    """Every stage of ``plan`` estimated on its real slots and links, summed per the placement.

    ``cache`` (a dict the caller keeps for one workload, profile and scales) reuses the
    estimate of a layout that several plans share.
    """
    cache = {} if cache is None else cache
    fill_cache([plan], workload, models=models, profile=profile, scales=scales, cache=cache)
    stages = {s: cache[_key(s, layout)] for s, layout in plan.layouts.items()}
    sync = 0.0
    train, gen = plan.layouts.get("actor/train"), plan.layouts.get(GENERATE)
    if train is not None and gen is not None:
        colocated = sync_colocated(train, gen)
        sync = weight_sync_s(train, gen, models["actor"], profile, colocated=colocated) * sync_scale
    step = step_seconds(plan.layouts, {s: e.seconds for s, e in stages.items()}, sync, overlap=overlap)
    top = max(max(layout.devices) for layout in plan.layouts.values()) + 1
    resident, transient = np.zeros(top), np.zeros(top)
    for s, layout in plan.layouts.items():  # memory_per_device, vectorized over slots
        idx = slots(layout)
        resident[idx] += stages[s].memory.persistent
        transient[idx] = np.maximum(transient[idx], stages[s].memory.transient)
    peak = int((resident + transient).max())
    return PlanEstimate(plan=plan, stages=stages, sync_s=sync, step_s=step, memory_peak=peak, usable=usable)


def _key(stage: str, layout: Layout) -> tuple:
    return (stage, layout.tp, layout.pp, layout.dp, layout.micro_batches, layout.devices)


def fill_cache(
    plans: list[GlobalPlan],
    workload: Workload,
    *,
    models: Mapping[str, ModelConfig],
    profile: HardwareProfile,
    scales: Scales,
    cache: dict,
) -> None:
    """Estimate, one vectorized pass per model-stage, every layout of ``plans`` not yet in ``cache``."""
    todo: dict[str, dict[tuple, Layout]] = {}
    for plan in plans:
        for s, layout in plan.layouts.items():
            if _key(s, layout) not in cache:
                todo.setdefault(s, {})[_key(s, layout)] = layout
    for s, layouts in todo.items():
        found = estimate_many(s, list(layouts.values()), workload, models[model_of(s)], profile, scales)
        cache.update(zip(layouts, found, strict=True))
