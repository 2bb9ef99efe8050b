"""The controller: after every step, recalibrate, search, and decide whether a new plan pays for its move.

Boundary: ``decide(observation, state) -> Decision`` is a pure function. It reads
what the step measured, refits the cost model's scales from every observation so
far, remembers what the plan in force measured (``controller.history``), searches
memory-feasible plans (``controller.search``) and lets the admission rules
(``admission``) keep or switch. It carries nothing out: the flow runs the
transition it asks for and reports back in the next observation.

A controller that does not thrash:
- plans are compared like with like: each plan's calibrated prediction on the next
  workload, times its own measured/predicted ratio when it ran here, else the plan in
  force's (``admission``); a plan left for one that measured faster is not chosen again
  until the workload or the devices change;
- an unforced gain must exceed ``min_gain`` of the step and the plan in force's
  step-to-step noise, as well as pay for the move over the horizon;
- a new plan must fit the forecast high response length with ``choose_headroom`` of
  the usable memory to spare; the plan in force is checked against today's workload
  and the plain headroom, so small growth does not force a move every few steps. A plan
  that fits only without that margin is weighed too, charged a second move, when it is
  ``min_tight_gain`` faster (``admission``).

The data types live in ``controller.state`` and are re-exported here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from nereus_core.config import Workload
from nereus_core.controller import admission, history, probe
from nereus_core.controller.move_price import TransferPlanner, move_price
from nereus_core.controller.search import Searcher, SearchSpace
from nereus_core.controller.state import (
    Alternative,
    ControllerSettings,
    ControllerState,
    Decision,
    Observation,
    PlanRecord,
    ProbeRequest,
    ProbeTiming,
    ShapeSample,
    StageTiming,
    TransitionTiming,
)
from nereus_core.cost.calibration import Sample, fit_scales
from nereus_core.cost.plan_estimate import PlanEstimate, fill_cache
from nereus_core.cost.plan_estimate import evaluate_plan as plan_estimate
from nereus_core.cost.stage_cost import Scales, estimate
from nereus_core.cost.transition_cost import (
    TransitionScales,
)
from nereus_core.plan import GlobalPlan, model_of

__all__ = [
    "Alternative",
    "ControllerSettings",
    "ControllerState",
    "Decision",
    "Observation",
    "PlanRecord",
    "ProbeRequest",
    "ProbeTiming",
    "StageTiming",
    "TransitionTiming",
    "calibrated_on",
    "decide",
    "evaluate_plan",
    "observe",
]


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
    """Add the step's timings to the samples and refit the scales from all of them; note the
    step's high response length for the forecast."""
    samples, shapes = list(state.samples), []
    for timing in observation.timings:
        work = timing.workload or observation.workload
        model = state.models[model_of(timing.stage)]
        raw = tuple(estimate(timing.stage, timing.layout, work, model, state.profile).raw.values())
        samples.append(Sample(raw, timing.seconds))
        shapes.append(
            ShapeSample(shape=history.shape_of(timing.stage, timing.layout), raw=raw, seconds=timing.seconds)
        )
    samples += [probe.sample(p, state) for p in observation.probes]
    s = state.settings
    cal = s.calibration
    samples = samples[-cal.max_samples :]
    scales = state.scales
    if observation.timings or observation.probes:
        scales = Scales.from_array(fit_scales(samples, cal, start=scales.as_array()))
    if observation.transition is not None:
        state = calibrated_on(state, [observation.transition])
    high = observation.workload.response_high
    return state.model_copy(
        update={
            "samples": tuple(samples),
            "shapes": history.push_shapes(state.shapes, shapes),
            "scales": scales,
            "steps_since_switch": state.steps_since_switch + (1 if state.plan is not None else 0),
            "highs": history.push_high(state.highs, observation.step, high, s.forecast_window),
        }
    )


def calibrated_on(state: ControllerState, transitions: Sequence[TransitionTiming]) -> ControllerState:
    """``state`` with the transitions that ran (the last one, or on resume all the job's committed
    switches read back from its records) added to the transition samples, the scales refitted: the
    one place transition calibration changes."""
    if not transitions:
        return state
    cal = state.settings.transition_calibration or state.settings.calibration
    samples = [*state.transition_samples, *(Sample(t.predicted.terms, t.seconds) for t in transitions)]
    samples = samples[-cal.max_samples :]
    start = state.transition_scales.as_array()
    scales = TransitionScales.from_array(fit_scales(samples, cal, start=start))
    return state.model_copy(update={"transition_samples": tuple(samples), "transition_scales": scales})


def _remember(
    observation: Observation, state: ControllerState, current: PlanEstimate | None, usable: int
) -> ControllerState:
    """The state with what the plan in force measured in this observation's timings, beside the
    calibrated prediction for the workload those timings ran."""
    if state.plan is None or current is None or state.devices is None:
        return state
    s = state.settings
    work = history.measured_workload(state.plan, observation.timings) or observation.workload
    at = current if work == observation.workload else evaluate_plan(state.plan, work, state, usable)
    seconds = history.step_measurement(state.plan, at, observation.timings, overlap=s.overlap_disaggregated)
    if seconds is None:
        return state
    records = history.remember(
        state.records,
        state.plan,
        seconds=seconds,
        predicted=_pricing(state).terms(at),
        workload=work,
        devices=state.devices,
        step=observation.step,
        margin=s.workload_margin,
    )
    return state.model_copy(update={"records": records})


def _candidates(
    devices: int, workload: Workload, state: ControllerState, budget: int, usable: int, cache: dict
) -> tuple[list[PlanEstimate], list, list]:
    """Exactly evaluated top-k plans fitting ``budget`` (fastest first; reported against ``usable``),
    the search's memory rejections, and one-stage variants of the best (search estimates)."""
    s = state.settings
    space = SearchSpace(
        devices=devices,
        budget=float(budget),
        disaggregated=s.disaggregated,
        overlap=s.overlap_disaggregated,
        buckets=s.memory_buckets,
        pipelined_generation=s.rollout_engine != "vllm",  # vLLM engines generate with pp=1
    )
    wire = state.transition_scales.wire
    found = Searcher(
        space, workload, state.models, state.profile, state.scales, wire, stages=state.stages
    ).run()
    top = [f.plan for f in found.feasible[: s.top_k]]
    # Plans that ran here are weighed too (by what they measured), wherever the search ranks them.
    ran = history.measured_plans(state.records, workload, devices, s.workload_margin)
    top += [p for p in ran if p not in top and p.devices[-1] < devices]
    models, profile, scales = state.models, state.profile, state.scales
    fill_cache(top, workload, models=models, profile=profile, scales=scales, cache=cache)
    exact = [evaluate_plan(plan, workload, state, usable, cache) for plan in top]
    exact = sorted((e for e in exact if e.memory_peak <= budget), key=lambda e: e.step_s)
    return exact, found.rejected, found.variants


def _tight_may_pay(exact: Sequence[PlanEstimate], rejected: Sequence, gain: float) -> bool:
    """Whether a plan the choosing margin ruled out may be ``gain`` faster than the best kept one
    (the search's memory rejections bound what a looser budget could find)."""
    if not exact:
        return bool(rejected)
    return any(f.seconds < exact[0].step_s * (1.0 - gain) for f in rejected)


def _option(
    e: PlanEstimate,
    observation: Observation,
    state: ControllerState,
    planner: TransferPlanner | None,
) -> admission.Option:
    """A candidate as admission weighs it: its measured/predicted ratio here if it ran, and whether
    it was left for a plan that measured faster."""
    margin = state.settings.workload_margin
    record = history.find(state.records, e.plan.plan_id, observation.workload, observation.devices, margin)
    durable = state.plan is not None and state.devices not in (None, observation.devices)  # a new world
    move, moves = move_price(state.plan, e.plan, state, planner, durable=durable, observation=observation)
    return admission.Option(
        est=e,
        move=move,
        ratio=history.ratio(record, _pricing(state)),
        left_for=record.left_for if record is not None else None,
        moves=moves,
    )


def _pricing(state: ControllerState) -> history.Pricing:
    s = state.settings
    return history.Pricing(state.scales, state.transition_scales.wire, s.overlap_disaggregated)


def _record_here(observation: Observation, state: ControllerState) -> PlanRecord | None:
    """The plan in force's record on this workload and these devices, if it has one."""
    if state.plan is None:
        return None
    margin = state.settings.workload_margin
    return history.find(state.records, state.plan.plan_id, observation.workload, observation.devices, margin)


def decide(
    observation: Observation, state: ControllerState, *, transfers: TransferPlanner | None = None
) -> Decision:
    """Keep the current plan or switch to a better one (see the module docstring)."""
    started = time.perf_counter()
    state = observe(observation, state)
    s = state.settings
    usable = int(observation.memory_per_device * (1.0 - s.headroom))
    current, cache = None, {}
    if state.plan is not None and state.plan.devices[-1] < observation.devices:
        current = evaluate_plan(state.plan, observation.workload, state, usable, cache)
    state = _remember(observation, state, current, usable)
    forced = admission.forced_reason(observation, state.plan, state.devices, current)
    here = _record_here(observation, state)
    pricing = _pricing(state)
    residuals = history.shape_residuals(state.shapes, state.scales)

    def shaped(e: PlanEstimate) -> float:
        return history.shaped_step(e, residuals, overlap=s.overlap_disaggregated)

    ratio, spread = history.ratio(here, pricing) or 1.0, history.spread(here, pricing, state.records)
    shape = shaped(current) / current.step_s if current is not None and current.step_s > 0 else 1.0
    basis = admission.Basis(ratio, spread, shape)
    options, rejected, variants = _weigh(
        observation, state, usable, cache, forced=bool(forced), planner=transfers
    )
    options = [o._replace(shaped_s=shaped(o.est)) for o in options]
    horizon = min(observation.remaining_steps, s.horizon)
    verdict = _verdict(
        forced, options, rejected, state, current=current, basis=basis, horizon=horizon, usable=usable
    )
    return _finish(
        verdict, observation, state, current, basis, history.measured(here), horizon, variants, started
    )


def _weigh(
    observation: Observation,
    state: ControllerState,
    usable: int,
    cache: dict,
    *,
    forced: bool,
    planner: TransferPlanner | None,
) -> tuple[list[admission.Option], list, list]:
    """The candidates admission weighs, each priced with its move; the search's memory rejections
    and one-stage variants. Chosen for the forecast workload with ``choose_headroom`` to spare; plans
    that fit only without it are weighed too (charged a second move) when forced, or when the search
    saw a plan ``min_tight_gain`` faster than the best it kept; when forced and nothing fits the
    forecast, a plan that fits today beats stopping the job."""
    s = state.settings
    choosing = history.forecast(observation.workload, state.highs, s.forecast_steps)
    cache_choose = cache if choosing == observation.workload else {}
    budget = int(usable * (1.0 - s.choose_headroom))
    exact, rejected, variants = _candidates(
        observation.devices, choosing, state, budget, usable, cache_choose
    )
    tight: list[PlanEstimate] = []
    if budget < usable and (forced or _tight_may_pay(exact, rejected, s.min_tight_gain)):
        loose, loose_rejected, loose_variants = _candidates(
            observation.devices, choosing, state, usable, usable, cache_choose
        )
        have = {e.plan.plan_id for e in exact}
        tight = [e for e in loose if e.plan.plan_id not in have]
        if not exact:
            rejected, variants = loose_rejected, loose_variants
    if forced and not exact and not tight and (budget < usable or choosing != observation.workload):
        exact, rejected, variants = _candidates(
            observation.devices, observation.workload, state, usable, usable, cache
        )
    options = [_option(e, observation, state, planner) for e in exact]
    options += [_option(e, observation, state, planner)._replace(tight=True) for e in tight]
    return options, rejected, variants


def _verdict(
    forced: str,
    options: list[admission.Option],
    rejected: list,
    state: ControllerState,
    *,
    current: PlanEstimate | None,
    basis: admission.Basis,
    horizon: int,
    usable: int,
) -> admission.Verdict:
    """The admission rules' verdict: a forced move takes the best plan that fits; an unforced one
    must pay for itself over the horizon (``admission``)."""
    s = state.settings
    if forced:
        return admission.forced(
            forced,
            options,
            rejected,
            current=current,
            basis=basis,
            horizon=horizon,
            usable=usable,
            tight_gain=s.min_tight_gain,
        )
    assert current is not None
    return admission.admit(
        options,
        rejected,
        current=current,
        basis=basis,
        horizon=horizon,
        settings=s,
        steps_since_switch=state.steps_since_switch,
    )


def _finish(
    verdict: admission.Verdict,
    observation: Observation,
    state: ControllerState,
    current: PlanEstimate | None,
    basis: admission.Basis,
    current_measured: float | None,
    horizon: int,
    variants: list,
    started: float,
) -> Decision:
    action, chosen = verdict.action, verdict.chosen
    plan = {"keep": state.plan, "switch": chosen.est.plan if chosen else None, "none": None}[action]
    alternatives = admission.with_variants(verdict.alternatives, variants, plan, current)
    records = state.records
    left = action == "switch" and not verdict.forced and chosen is not None and chosen.measured
    if left and current_measured is not None and state.plan is not None:  # both measured: it was slower
        records = history.mark_left(records, state.plan.plan_id, chosen.est.plan.plan_id)
    new_state = state.model_copy(
        update={
            "plan": plan if action != "none" else state.plan,
            "devices": observation.devices,
            "steps_since_switch": 0 if action == "switch" else state.steps_since_switch,
            "records": records,
        }
    )
    gain = basis.gain(current, chosen) if (current is not None and chosen) else 0.0
    moving = chosen is not None and (action == "switch" or verdict.forced)
    probes = (
        probe.requests(plan, observation.workload, new_state) if probe.due(state, observation.step) else ()
    )
    if probes:
        new_state = new_state.model_copy(update={"probed_at": observation.step})
    return Decision(
        action=action,
        forced=verdict.forced,
        reason=verdict.reason,
        plan=plan,
        current=current,
        chosen=chosen.est if chosen else None,
        gain_per_step_s=gain,
        current_measured_s=current_measured,
        horizon_steps=horizon,
        transition=chosen.move if moving else None,
        moves=chosen.moves if moving else None,
        alternatives=tuple(alternatives[: state.settings.max_alternatives]),
        probes=probes,
        state=new_state,
        elapsed_s=time.perf_counter() - started,
    )
