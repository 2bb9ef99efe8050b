"""The controller: after every step, recalibrate, search, and decide whether a new plan pays for its move.

Boundary: ``decide(observation, state) -> Decision`` is a pure function. It reads
what the step measured, refits the cost model's scales from every observation so
far, searches memory-feasible plans (``plan_search``), and keeps or switches. It
carries nothing out: the flow runs the transition it asks for and reports back
in the next observation.

Admission (DESIGN.md): switch iff ``(T_now - T_new) * H >= (1 + margin) * C``, with
H the remaining steps capped by ``horizon``, and at least ``dwell`` steps since the
last switch. Among the fastest ``top_k`` plans the one with the largest net gain
``(T_now - T_new) * H - (1 + margin) * C`` is taken, so a slightly slower plan that
is much cheaper to reach can win. A switch is forced (no dwell, no margin) when
there is no plan yet, the device set changed, or the current plan no longer fits
(predicted, or a measured peak above capacity); then the plan minimising
``T_new * H + C`` is taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from nereus_core.calibration import CalibrationSettings, Sample, fit_scales
from nereus_core.config import ModelConfig
from nereus_core.cost_model import (
    Scales,
    TransferLike,
    TransitionEstimate,
    TransitionScales,
    Workload,
    analytic_transition_cost,
    estimate,
    transition_cost,
)
from nereus_core.hardware import HardwareProfile
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan, ModelStage, model_of, models_for
from nereus_core.plan_estimate import PlanEstimate, fill_cache
from nereus_core.plan_estimate import evaluate_plan as plan_estimate
from nereus_core.plan_search import Searcher, SearchSpace

GiB = 1024**3


def _size(n: float) -> str:
    """Bytes as GiB, or MiB below 1 GiB (tiny models on small slots stay readable)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


TransferPlanner = Callable[[GlobalPlan, GlobalPlan], Sequence[TransferLike]]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ControllerSettings(_Frozen):
    """When a plan change is admitted, and what the search may consider."""

    margin: float = Field(default=0.2, ge=0, le=100, description="Gain must beat (1 + margin) x cost.")
    horizon: int = Field(default=50, ge=1, le=1_000_000, description="Most future steps a gain is credited.")
    dwell: int = Field(default=3, ge=0, le=1_000_000, description="Fewest steps between unforced switches.")
    headroom: float = Field(default=0.1, ge=0, lt=1, description="Share of device memory kept free.")
    top_k: int = Field(default=8, ge=1, le=256, description="Fastest plans weighed against their cost.")
    disaggregated: bool = Field(default=True, description="Also consider generation on its own slots.")
    overlap_disaggregated: bool = Field(
        default=False,
        description="Disaggregated pools overlap steps (one-step off-policy); else they take turns.",
    )
    memory_buckets: int = Field(default=64, ge=8, le=4096, description="Memory resolution of the search.")
    max_alternatives: int = Field(default=5, ge=0, le=100, description="Rejected plans reported.")
    calibration: CalibrationSettings = CalibrationSettings()


class StageTiming(_Frozen):
    """How long one model-stage took in the last step, on which layout."""

    stage: ModelStage
    layout: Layout
    seconds: float = Field(gt=0)
    workload: Workload | None = Field(
        default=None, description="The step's workload if not the observation's."
    )


class TransitionTiming(_Frozen):
    """A transition that ran: what was predicted (unscaled terms inside) and how long it took."""

    predicted: TransitionEstimate
    seconds: float = Field(gt=0)


class Observation(_Frozen):
    """What the job reports after a step."""

    step: int = Field(ge=0)
    remaining_steps: int = Field(ge=0, description="Steps still to run.")
    devices: int = Field(ge=1, description="Device slots available now (slots 0..devices-1).")
    memory_per_device: int = Field(gt=0, description="Capacity of one slot, bytes.")
    workload: Workload = Field(description="The workload expected next (e.g. recent response lengths).")
    timings: tuple[StageTiming, ...] = ()
    memory_peaks: dict[int, int] = Field(default_factory=dict, description="Measured peak bytes per slot.")
    transition: TransitionTiming | None = None


class ControllerState(_Frozen):
    """Everything ``decide`` carries from one step to the next."""

    models: dict[str, ModelConfig]
    profile: HardwareProfile
    settings: ControllerSettings = ControllerSettings()
    plan: GlobalPlan | None = None
    devices: int | None = None
    steps_since_switch: int = 0
    samples: tuple[Sample, ...] = ()
    transition_samples: tuple[Sample, ...] = ()
    scales: Scales = Scales()
    transition_scales: TransitionScales = TransitionScales()

    @classmethod
    def initial(
        cls,
        model: ModelConfig,
        profile: HardwareProfile,
        settings: ControllerSettings | None = None,
        plan: GlobalPlan | None = None,
        devices: int | None = None,
    ) -> ControllerState:
        settings = settings or ControllerSettings()
        return cls(
            models=models_for(model),
            profile=profile,
            settings=settings,
            plan=plan,
            devices=devices,
            steps_since_switch=settings.dwell,  # a plan the job starts on is not a switch: no dwell
        )


Reason = Literal["memory", "slower", "not_worth_it", "dwell", "current"]


class Alternative(_Frozen):
    plan_id: str
    description: str
    step_s: float
    memory_peak: int
    reason: Reason
    detail: str


class Decision(_Frozen):
    """Keep or switch, with the numbers behind it."""

    action: Literal["keep", "switch", "none"] = Field(description="none: no plan fits in memory.")
    forced: bool
    reason: str
    plan: GlobalPlan | None = Field(description="The plan to run next (None when nothing fits).")
    current: PlanEstimate | None
    chosen: PlanEstimate | None = Field(description="The best candidate weighed (the new plan on a switch).")
    gain_per_step_s: float
    horizon_steps: int
    transition: TransitionEstimate | None
    alternatives: tuple[Alternative, ...]
    state: ControllerState
    elapsed_s: float


def evaluate_plan(
    plan: GlobalPlan, workload: Workload, state: ControllerState, usable: int, cache: dict | None = None
) -> PlanEstimate:
    """``plan.evaluate_plan`` with the state's models, profile and calibrated scales."""
    return plan_estimate(
        plan,
        workload,
        models=state.models,
        profile=state.profile,
        scales=state.scales,
        sync_scale=state.transition_scales.wire,
        overlap=state.settings.overlap_disaggregated,
        usable=usable,
        cache=cache,
    )


def observe(observation: Observation, state: ControllerState) -> ControllerState:
    """Add the step's timings to the samples and refit the scales from all of them."""
    samples = list(state.samples)
    for timing in observation.timings:
        work = timing.workload or observation.workload
        model = state.models[model_of(timing.stage)]
        raw = estimate(timing.stage, timing.layout, work, model, state.profile).raw
        samples.append(Sample(tuple(raw.values()), timing.seconds))
    transition_samples = list(state.transition_samples)
    if observation.transition is not None:
        p = observation.transition.predicted
        transition_samples.append(Sample((p.wire_s, p.ops_s), observation.transition.seconds))
    cal = state.settings.calibration
    samples, transition_samples = samples[-cal.max_samples :], transition_samples[-cal.max_samples :]
    scales = state.scales
    if observation.timings:
        scales = Scales.from_array(fit_scales(samples, cal, start=scales.as_array()))
    tscales = state.transition_scales
    if observation.transition is not None:
        wire, ops = fit_scales(transition_samples, cal, start=tscales.as_array())
        tscales = TransitionScales(wire=float(wire), ops=float(ops))
    return state.model_copy(
        update={
            "samples": tuple(samples),
            "transition_samples": tuple(transition_samples),
            "scales": scales,
            "transition_scales": tscales,
            "steps_since_switch": state.steps_since_switch + (1 if state.plan is not None else 0),
        }
    )


def _forced_reason(observation: Observation, state: ControllerState, current: PlanEstimate | None) -> str:
    """Why the current plan must change now, or '' if it may stay."""
    capacity = observation.memory_per_device
    if state.plan is None:
        return "no current plan"
    if state.devices is not None and state.devices != observation.devices:
        return f"device set changed ({state.devices} -> {observation.devices} slots)"
    if current is None:
        return (
            f"the current plan uses slot {state.plan.devices[-1]}, beyond the {observation.devices} available"
        )
    over = {d: b for d, b in observation.memory_peaks.items() if b > capacity}
    if over:
        d = max(over, key=lambda k: over[k])
        return f"slot {d} peaked at {_size(over[d])} > capacity {_size(capacity)}"
    if not current.fits:
        return (
            f"the current plan needs {_size(current.memory_peak)} per slot > usable {_size(current.usable)}"
        )
    return ""


def _transition(
    current: GlobalPlan | None, new: GlobalPlan, state: ControllerState, planner: TransferPlanner | None
) -> TransitionEstimate:
    if current is None or current == new:
        return TransitionEstimate.of(0.0, 0.0, None, critical_bytes=0, transfers=0, analytic=True)
    if planner is not None:
        return transition_cost(planner(current, new), state.profile, state.transition_scales)
    return analytic_transition_cost(
        dict(current.layouts), dict(new.layouts), state.models, state.profile, state.transition_scales
    )


def _candidates(
    observation: Observation, state: ControllerState, usable: int, cache: dict
) -> tuple[list, list, list]:
    """Exactly evaluated top-k feasible plans (fastest first), the search's memory rejections, and
    one-stage variants of the best (search estimates, for the report)."""
    s = state.settings
    space = SearchSpace(
        devices=observation.devices,
        budget=float(usable),
        disaggregated=s.disaggregated,
        overlap=s.overlap_disaggregated,
        buckets=s.memory_buckets,
    )
    wire = state.transition_scales.wire
    found = Searcher(space, observation.workload, state.models, state.profile, state.scales, wire).run()
    top = [f.plan for f in found.feasible[: s.top_k]]
    models, profile, scales = state.models, state.profile, state.scales
    fill_cache(top, observation.workload, models=models, profile=profile, scales=scales, cache=cache)
    exact = [evaluate_plan(plan, observation.workload, state, usable, cache) for plan in top]
    exact = sorted((e for e in exact if e.fits), key=lambda e: e.step_s)
    return exact, found.rejected, found.variants


def _alternative(
    e: PlanEstimate | None, reason: Reason, detail: str, *, plan=None, step=0.0, mem=0
) -> Alternative:
    plan = plan if e is None else e.plan
    return Alternative(
        plan_id=plan.plan_id,
        description=plan.describe(),
        step_s=step if e is None else e.step_s,
        memory_peak=mem if e is None else e.memory_peak,
        reason=reason,
        detail=detail,
    )


def decide(
    observation: Observation, state: ControllerState, *, transfers: TransferPlanner | None = None
) -> Decision:
    """Keep the current plan or switch to a better one (see the module docstring)."""
    started = time.perf_counter()
    state = observe(observation, state)
    usable = int(observation.memory_per_device * (1.0 - state.settings.headroom))
    current, cache = None, {}
    if state.plan is not None and state.plan.devices[-1] < observation.devices:
        current = evaluate_plan(state.plan, observation.workload, state, usable, cache)
    forced = _forced_reason(observation, state, current)
    exact, rejected, variants = _candidates(observation, state, usable, cache)
    horizon = min(observation.remaining_steps, state.settings.horizon)
    weighed = [(e, _transition(state.plan, e.plan, state, transfers)) for e in exact]
    args = dict(
        observation=observation,
        state=state,
        current=current,
        horizon=horizon,
        started=started,
        variants=variants,
    )
    if forced:
        return _forced(forced, weighed, rejected, **args)
    return _admit(weighed, rejected, **args)


def _finish(
    action: Literal["keep", "switch", "none"],
    reason: str,
    chosen: tuple[PlanEstimate, TransitionEstimate] | None,
    alternatives: list[Alternative],
    *,
    forced: bool,
    observation: Observation,
    state: ControllerState,
    current: PlanEstimate | None,
    horizon: int,
    started: float,
    variants: list,
) -> Decision:
    plan = {"keep": state.plan, "switch": chosen[0].plan if chosen else None, "none": None}[action]
    alternatives = _with_variants(alternatives, variants, plan, current)
    new_state = state.model_copy(
        update={
            "plan": plan if action != "none" else state.plan,
            "devices": observation.devices,
            "steps_since_switch": 0 if action == "switch" else state.steps_since_switch,
        }
    )
    gain = current.step_s - chosen[0].step_s if (current is not None and chosen) else 0.0
    return Decision(
        action=action,
        forced=forced,
        reason=reason,
        plan=plan,
        current=current,
        chosen=chosen[0] if chosen else None,
        gain_per_step_s=gain,
        horizon_steps=horizon,
        transition=chosen[1] if chosen and action == "switch" else None,
        alternatives=tuple(alternatives[: state.settings.max_alternatives]),
        state=new_state,
        elapsed_s=time.perf_counter() - started,
    )


def _with_variants(
    alternatives: list[Alternative], variants: list, plan: GlobalPlan | None, current: PlanEstimate | None
) -> list[Alternative]:
    """Add the best plan's one-stage variants (search estimates), once each, after the others."""
    seen = {a.plan_id for a in alternatives} | {p.plan_id for p in (plan, current and current.plan) if p}
    out = list(alternatives)
    for f in variants:
        if f.plan.plan_id not in seen:
            seen.add(f.plan.plan_id)
            detail = "one model-stage on its next-fastest layout (search estimate)"
            out.append(_alternative(None, "slower", detail, plan=f.plan, step=f.seconds, mem=int(f.memory)))
    out.sort(key=lambda a: (a.reason != "memory", a.step_s))
    return out


def _memory_rejections(rejected: list, faster_than: float, usable: int) -> list[Alternative]:
    return [
        _alternative(
            None,
            "memory",
            f"needs {_size(f.memory)} per slot > usable {_size(usable)}",
            plan=f.plan,
            step=f.seconds,
            mem=int(f.memory),
        )
        for f in rejected
        if f.seconds < faster_than and np.isfinite(f.seconds)
    ]


def _forced(reason: str, weighed: list, rejected: list, **args) -> Decision:
    state: ControllerState = args["state"]
    current: PlanEstimate | None = args["current"]
    usable = int(args["observation"].memory_per_device * (1.0 - state.settings.headroom))
    if not weighed:
        alts = _memory_rejections(rejected, float("inf"), usable)
        return _finish("none", f"{reason}; no plan fits in memory", None, alts, forced=True, **args)
    h = max(args["horizon"], 1)
    best = min(weighed, key=lambda et: et[0].step_s * h + et[1].seconds)
    alts = _memory_rejections(rejected, best[0].step_s, usable)
    for e, c in weighed:
        if e.plan != best[0].plan and (current is None or e.plan != current.plan):
            total, mine = e.step_s * h + c.seconds, best[0].step_s * h + best[1].seconds
            alts.append(_alternative(e, "slower", f"{total:.3g} s over {h} steps incl. move vs {mine:.3g} s"))
    if current is not None and best[0].plan == current.plan:
        return _finish(
            "keep", f"{reason}; the current plan is still the best", best, alts, forced=True, **args
        )
    return _finish("switch", reason, best, alts, forced=True, **args)


def _admit(weighed: list, rejected: list, **args) -> Decision:
    state: ControllerState = args["state"]
    current: PlanEstimate = args["current"]
    settings, h = state.settings, args["horizon"]
    usable = current.usable
    factor = 1.0 + settings.margin
    others = [(e, c) for e, c in weighed if e.plan != current.plan]
    if not others:
        alts = _memory_rejections(rejected, current.step_s, usable)
        return _finish("keep", "the current plan is the fastest that fits", None, alts, forced=False, **args)
    best = max(others, key=lambda ec: (current.step_s - ec[0].step_s) * h - factor * ec[1].seconds)
    gain = current.step_s - best[0].step_s
    pays = gain > 0 and gain * h >= factor * best[1].seconds
    dwelling = state.steps_since_switch < settings.dwell
    alts = _memory_rejections(rejected, min(current.step_s, best[0].step_s), usable)
    for e, c in others:
        g = current.step_s - e.step_s
        if g <= 0:
            alts.append(_alternative(e, "slower", f"{-g:+.3g} s per step vs the current plan"))
        elif (e, c) is not best or not pays:
            detail = f"gain {g:.3g} s/step x {h} steps = {g * h:.3g} s < {factor:g} x move {c.seconds:.3g} s"
            if g * h >= factor * c.seconds:
                detail = (
                    f"pays ({g * h:.3g} s >= {factor:g} x {c.seconds:.3g} s) but nets less than the chosen"
                )
            alts.append(_alternative(e, "not_worth_it", detail))
    if pays and dwelling:
        alts.append(_alternative(best[0], "dwell", f"{state.steps_since_switch} steps since the last switch"))
        msg = f"dwell: {state.steps_since_switch} < {settings.dwell} steps since the last switch"
        return _finish("keep", msg, best, alts, forced=False, **args)
    if not pays:
        return _finish("keep", "no faster plan pays for its move", best, alts, forced=False, **args)
    msg = f"gain {gain:.3g} s/step x {h} steps >= {factor:g} x move {best[1].seconds:.3g} s"
    return _finish("switch", msg, best, alts, forced=False, **args)
