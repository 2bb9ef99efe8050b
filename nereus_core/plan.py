"""Global plans: the layouts of all model-stages together, their id, placement and plan-level sums.

Boundary: what a plan *is* and how its stages' estimates add up (step time,
memory per device). Which plan to run is the controller's business
(``controller.py``); the per-stage numbers come from ``cost_model.py``.

Placement (DESIGN.md, "global plan"):
- ``colocated``: every model-stage on the same slots, time-shared; stages run one
  after another, so a step takes the sum of the stage times (verl's default).
- ``disaggregated``: ``actor/generate`` on its own slots, the other five on the
  rest. With ``overlap`` the generation of step k+1 runs while the rest of step k
  trains (one-step off-policy, as OpenRLHF's async mode and verl's fully_async), so
  a step takes the longer of the two pools (generation waits for the weight sync);
  without it the pools take turns and
  idle (OpenRLHF's default). Either way the actor's new weights are sent to the
  generation copy every step (``cost_model.weight_sync_s``).

Memory per device: state that stays between stages (weights, optimizer state)
of every model-stage on the device adds up; gradients, activations and KV caches
live only while their stage runs, so the largest of them counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from functools import cached_property
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from nereus_core.config import ModelConfig, NereusConfig
from nereus_core.cost_model import Estimate, MemoryEstimate, Scales, Workload, estimate_many, weight_sync_s
from nereus_core.cost_terms import is_contiguous, slots
from nereus_core.hardware import HardwareProfile
from nereus_core.layout import MODEL_STAGES, Layout, ModelStage

Placement = Literal["colocated", "disaggregated"]
GENERATE = "actor/generate"
MODELS = ("actor", "critic", "reference", "reward")


def model_of(stage: str) -> str:
    """``'critic/train'`` -> ``'critic'``."""
    return stage.partition("/")[0]


def models_for(model: ModelConfig) -> dict[str, ModelConfig]:
    """The four PPO models built from one config: critic and reward carry a value head when
    ``ModelConfig`` knows heads (actor and reference keep the lm head)."""
    if "head" not in type(model).model_fields:
        return dict.fromkeys(MODELS, model)
    value = model.model_copy(update={"head": "value"})
    lm = model.model_copy(update={"head": "lm"})
    return {"actor": lm, "critic": value, "reference": lm, "reward": value}


class GlobalPlan(BaseModel):
    """Layouts of model-stages (usually all six) and how they share the device slots."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    placement: Placement = Field(description="colocated (all stages time-share slots) or disaggregated.")
    layouts: dict[ModelStage, Layout] = Field(description="Layout of each model-stage.")

    @model_validator(mode="after")
    def _check(self) -> GlobalPlan:
        if not self.layouts:
            raise ValueError(
                f"a plan needs at least one model-stage layout; valid: {', '.join(MODEL_STAGES)}"
            )
        return self

    @cached_property
    def plan_id(self) -> str:
        """Stable short id from the placement and every layout (same plan, same id, any process)."""
        digest = hashlib.sha1(self.placement.encode())
        for stage in sorted(self.layouts):
            v = self.layouts[stage]
            digest.update(f";{stage}=tp{v.tp}.pp{v.pp}.dp{v.dp}.m{v.micro_batches}@".encode())
            # consecutive slots by their range (converting 1,024 ints to bytes is slow)
            digest.update(
                f"{v.devices[0]}..{v.devices[-1]}".encode() if is_contiguous(v) else slots(v).tobytes()
            )
        return "plan-" + digest.hexdigest()[:12]

    def __hash__(self) -> int:
        return hash(self.plan_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GlobalPlan) and self.plan_id == other.plan_id

    @property
    def devices(self) -> tuple[int, ...]:
        """Every slot some model-stage uses, ascending."""
        return tuple(sorted({d for layout in self.layouts.values() for d in layout.devices}))

    def stages_on(self, device: int) -> list[str]:
        return [s for s, layout in self.layouts.items() if device in layout.devices]

    def describe(self) -> str:
        """One line, e.g. ``colocated | actor/generate tp2.pp1.dp2 m1 @0..3 | ...`` (@ first..last slot)."""
        parts = [
            f"{s} tp{v.tp}.pp{v.pp}.dp{v.dp} m{v.micro_batches} @{min(v.devices)}..{max(v.devices)}"
            for s, v in self.layouts.items()
        ]
        return " | ".join([self.placement, *parts])

    def problems(self, models: Mapping[str, ModelConfig], devices: int, batch: int) -> list[str]:
        """Why this plan cannot run on ``devices`` slots with a global ``batch`` (empty if it can)."""
        out = []
        for stage, layout in self.layouts.items():
            model = models[model_of(stage)]
            for problem in (
                model.tp_error(layout.tp),
                model.pp_error(layout.pp),
                layout.devices_error(devices),
            ):
                if problem:
                    out.append(f"{stage}: {problem}")
            if batch % (layout.dp * layout.micro_batches):
                out.append(f"{stage}: batch {batch} is not divisible by dp*micro_batches")
        return out

    @classmethod
    def from_config(cls, config: NereusConfig) -> GlobalPlan | None:
        """The config's initial plan, if it lays out every model-stage (else None)."""
        if set(config.plan) != set(MODEL_STAGES):
            return None
        return cls(placement=infer_placement(config.plan), layouts=dict(config.plan))


def infer_placement(layouts: Mapping[str, Layout]) -> Placement:
    """colocated when every model-stage uses the same slots, else disaggregated."""
    sets = {frozenset(layout.devices) for layout in layouts.values()}
    return "colocated" if len(sets) == 1 else "disaggregated"


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


def step_seconds(
    placement: Placement, stage_seconds: Mapping[str, float], sync_s: float, *, overlap: bool
) -> float:
    """Predicted step time of a plan from its stage times (see the module docstring)."""
    if placement == "colocated" or not overlap:
        return sum(stage_seconds.values()) + sync_s
    rest = sum(v for s, v in stage_seconds.items() if s != GENERATE)
    return max(stage_seconds.get(GENERATE, 0.0) + sync_s, rest)  # the new weights land before generating


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
        colocated = plan.placement == "colocated"
        sync = weight_sync_s(train, gen, models["actor"], profile, colocated=colocated) * sync_scale
    step = step_seconds(plan.placement, {s: e.seconds for s, e in stages.items()}, sync, overlap=overlap)
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
