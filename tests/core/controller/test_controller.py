"""nereus_core.controller.decide: search monotonicity, memory safety, admission, forced switches,
calibration."""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus_core.config import LLAMA_3_8B, ModelConfig, Workload
from nereus_core.controller.decide import (
    ControllerState,
    StageTiming,
    TransitionTiming,
    decide,
    evaluate_plan,
)
from nereus_core.cost.hardware import CPU_WORKERS, H100_SXM
from nereus_core.cost.plan_estimate import memory_per_device
from nereus_core.cost.stage_cost import estimate
from nereus_core.layout import Layout
from nereus_core.plan import MODEL_STAGES, GlobalPlan, PlanRules, model_of, problems
from tests.support.controller_setup import GB, fresh, observe, work
from tests.support.model_configs import MID

TINY = ModelConfig()
# Derandomized: the suite must not pass or fail by the draw; a counterexample found is kept below as
# an explicit case.
FAST = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def best_step(model: ModelConfig, profile, devices: int, capacity: int, w: Workload) -> float:
    d = decide(observe(devices, capacity, w), fresh(model, profile))
    return d.chosen.step_s if d.chosen is not None else float("inf")


@FAST
@given(
    n=st.integers(1, 12),
    extra=st.integers(1, 12),
    batch=st.sampled_from([8, 12, 16, 32]),
    mean=st.integers(8, 512),
    # 6 GB slots: below, where memory is tight enough that the choosing headroom decides
    capacity_gb=st.sampled_from([12, 80]),
    case=st.sampled_from(["mid-h100", "tiny-cpu"]),
)
def test_more_devices_never_predict_a_slower_best_step(n, extra, batch, mean, capacity_gb, case) -> None:
    model, profile = (MID, H100_SXM) if case == "mid-h100" else (TINY, CPU_WORKERS)
    w = work(batch=batch, prompt=32, mean=mean, high=2 * mean)
    fewer = best_step(model, profile, n, capacity_gb * GB, w)
    more = best_step(model, profile, n + extra, capacity_gb * GB, w)
    assert more <= fewer * (1 + 1e-9)


def test_more_devices_never_predict_a_slower_best_step_known_counterexample() -> None:
    """A counterexample the property's draws once found with 6 GB slots: on 8 slots the best plan fit
    only without the choosing headroom, so on 9 a plan 0.04 % slower that fit with it was taken. With
    train layouts sharded over dp (``Layout.shard``) among the choices, the 8-slot plan fits with the
    headroom, and 9 slots choose the same plan."""
    model, profile = MID, H100_SXM
    w = work(batch=8, prompt=32, mean=8, high=2 * 8)
    fewer = best_step(model, profile, 8, 6 * GB, w)
    more = best_step(model, profile, 9, 6 * GB, w)
    assert more <= fewer * (1 + 1e-9)


def _independent_peak(plan: GlobalPlan, state: ControllerState, w: Workload) -> int:
    """Memory per slot recomputed from estimate() and plan.memory_per_device (not the search)."""
    memory = {
        s: estimate(s, layout, w, state.models[model_of(s)], state.profile).memory
        for s, layout in plan.layouts.items()
    }
    return max(memory_per_device(plan, memory).values())


@FAST
@given(
    devices=st.integers(1, 24),
    capacity_gb=st.floats(2, 40),
    batch=st.sampled_from([4, 8, 16, 48]),
    mean=st.integers(16, 2048),
    headroom=st.sampled_from([0.0, 0.1, 0.3]),
)
def test_every_plan_the_controller_returns_fits_in_memory(
    devices, capacity_gb, batch, mean, headroom
) -> None:
    state = fresh(headroom=headroom)
    w = work(batch=batch, prompt=128, mean=mean, high=mean * 2)
    capacity = int(capacity_gb * GB)
    d = decide(observe(devices, capacity, w), state)
    if d.plan is None:
        assert d.action == "none" and d.chosen is None
        return
    usable = int(capacity * (1 - headroom))
    assert _independent_peak(d.plan, state, w) <= usable
    assert max(d.plan.devices) < devices
    assert problems(d.plan.layouts, PlanRules(models=state.models, devices=devices, batch=batch)) == []


def _running(plan_workload: Workload, devices: int, capacity: int, **kw) -> ControllerState:
    """A controller that has been running on the plan it picked for ``plan_workload``."""
    d = decide(observe(devices, capacity, plan_workload), fresh(**kw))
    assert d.plan is not None
    return d.state.model_copy(update={"steps_since_switch": 100})


@FAST
@given(
    margin=st.sampled_from([0.0, 0.2, 1.0, 5.0]),
    horizon=st.integers(1, 200),
    remaining=st.integers(0, 300),
    old_mean=st.integers(16, 256),
    new_mean=st.integers(16, 4096),
    devices=st.sampled_from([4, 8, 16]),
)
def test_the_controller_switches_only_when_the_gain_pays_for_the_move(
    margin, horizon, remaining, old_mean, new_mean, devices
) -> None:
    state = _running(work(mean=old_mean), devices, 80 * GB, margin=margin, horizon=horizon)
    d = decide(observe(devices, 80 * GB, work(mean=new_mean, high=2 * new_mean), remaining), state)
    h = min(remaining, horizon)
    assert d.horizon_steps == h
    if d.forced:
        return
    if d.action == "switch":
        assert d.transition is not None
        assert d.gain_per_step_s > 0
        assert d.gain_per_step_s * h >= (1 + margin) * d.transition.seconds
        assert d.state.plan == d.plan and d.state.steps_since_switch == 0
    else:
        assert d.plan == state.plan
        for alt in d.alternatives:
            assert alt.reason in ("memory", "slower", "not_worth_it")


def test_devices_changing_forces_a_switch_inside_the_new_pool() -> None:
    state = _running(work(), 16, 80 * GB)
    d = decide(observe(8, 80 * GB, work()), state)
    assert d.forced and "device set changed" in d.reason
    assert d.action == "switch" and max(d.plan.devices) < 8
    grown = decide(observe(32, 80 * GB, work()), state)
    assert grown.forced and grown.state.devices == 32


def test_a_plan_that_stops_fitting_forces_a_switch_to_one_that_fits() -> None:
    state = _running(work(mean=64), 8, 80 * GB)
    current = evaluate_plan(state.plan, work(mean=64), state, 80 * GB)
    tight = int(current.memory_peak / 0.9 * 0.8)  # usable memory below the current plan's need
    d = decide(observe(8, tight, work(mean=64)), state)
    assert d.forced and "current plan needs" in d.reason
    assert d.action in ("switch", "none")
    if d.plan is not None:
        assert d.chosen.memory_peak <= int(tight * 0.9)
    peaked = decide(observe(8, 80 * GB, work(mean=64), memory_peaks={3: 81 * GB}), state)
    assert peaked.forced and "slot 3 peaked" in peaked.reason


def test_dwell_holds_an_unforced_switch_back() -> None:
    bad = GlobalPlan(placement="colocated", layouts=dict.fromkeys(MODEL_STAGES, Layout.contiguous(dp=1)))
    base = fresh(dwell=5).model_copy(update={"plan": bad, "devices": 8, "steps_since_switch": 0})
    held = decide(observe(8, 80 * GB, work(batch=16, mean=256)), base)
    assert held.action == "keep" and held.reason.startswith("dwell")
    assert any(a.reason == "dwell" for a in held.alternatives)
    assert held.state.steps_since_switch == 1
    free = decide(
        observe(8, 80 * GB, work(batch=16, mean=256)), base.model_copy(update={"steps_since_switch": 5})
    )
    assert free.action == "switch" and not free.forced
    assert free.gain_per_step_s > 0 and free.transition is not None and free.transition.analytic


def test_first_decision_picks_a_plan_and_no_plan_fitting_is_reported() -> None:
    d = decide(observe(4, 80 * GB, work()), fresh())
    assert d.action == "switch" and d.forced and d.reason == "no current plan"
    assert set(d.plan.layouts) == set(MODEL_STAGES)
    none = decide(observe(1, GB, work()), fresh())
    assert none.action == "none" and none.plan is None and "no plan fits" in none.reason


def test_a_transfer_planner_replaces_the_analytic_estimate() -> None:
    bad = GlobalPlan(placement="colocated", layouts=dict.fromkeys(MODEL_STAGES, Layout.contiguous(dp=1)))
    base = fresh(dwell=0).model_copy(update={"plan": bad, "devices": 8})
    calls = []

    def planner(old: GlobalPlan, new: GlobalPlan) -> list[tuple[int, int, int]]:
        calls.append((old.plan_id, new.plan_id))
        return [(0, d, 10**6) for d in range(1, 8)]

    d = decide(observe(8, 80 * GB, work(batch=16, mean=256)), base, transfers=planner)
    assert calls and d.action == "switch" and d.transition is not None and not d.transition.analytic


def test_observed_timings_recalibrate_the_scales() -> None:
    state = fresh(TINY, CPU_WORKERS)
    w = work(batch=8, prompt=16, mean=16)
    timings = []
    for tp, dp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        layout = Layout.contiguous(tp=tp, dp=dp)
        for stage in ("actor/generate", "critic/infer", "actor/train"):
            predicted = estimate(stage, layout, w, state.models[model_of(stage)], CPU_WORKERS).seconds
            timings.append(StageTiming(stage=stage, layout=layout, seconds=3.0 * predicted))
    d = decide(observe(4, 2 * GB, w, timings=tuple(timings)), state)
    assert len(d.state.samples) == len(timings)

    def ratio(layout: Layout) -> float:
        before = estimate("actor/generate", layout, w, TINY, CPU_WORKERS).seconds
        return estimate("actor/generate", layout, w, TINY, CPU_WORKERS, d.state.scales).seconds / before

    assert ratio(Layout.contiguous(tp=2, dp=2)) == pytest.approx(3.0, rel=0.1)  # observed
    assert 1.5 < ratio(Layout.contiguous(tp=4)) < 3.3  # never observed: moves toward the truth


def test_decision_time_at_1024_devices_and_six_model_stages() -> None:
    state = fresh(LLAMA_3_8B)
    obs = observe(1024, 80 * GB, Workload(batch=1024, prompt_len=512, response_mean=1024, response_high=4096))
    decide(obs, state)
    cpu = []
    for _ in range(3):
        start = time.process_time()
        d = decide(obs, state)
        cpu.append(time.process_time() - start)
    assert d.chosen is not None and len(d.plan.devices) <= 1024
    # Loose here (a guard against a several-fold regression): CPU seconds on a 2-core machine whose
    # other core is busy read 0.18-0.32 for the same code. benchmarks/bench_controller.py measures
    # the 50 ms target.
    assert statistics.median(cpu) < 0.5


def test_measured_transitions_calibrate_the_transition_cost() -> None:
    bad = GlobalPlan(placement="colocated", layouts=dict.fromkeys(MODEL_STAGES, Layout.contiguous(dp=1)))
    state = fresh(dwell=0).model_copy(update={"plan": bad, "devices": 8})
    first = decide(observe(8, 80 * GB, work(batch=16, mean=256)), state)
    assert first.action == "switch" and first.transition is not None
    ran = TransitionTiming(predicted=first.transition, seconds=4.0 * first.transition.seconds)
    after = decide(observe(8, 80 * GB, work(batch=16, mean=256), transition=ran), first.state)
    assert len(after.state.transition_samples) == 1
    t = after.state.transition_scales
    refit = float(np.dot(t.as_array(), first.transition.terms))
    assert refit == pytest.approx(4.0 * first.transition.seconds, rel=0.1)


def test_a_change_of_devices_is_priced_durable_and_calibrated_on_the_durable_switches_that_ran() -> None:
    """A switch onto another device count rebuilds the world; its cost was predicted 0
    when the plan stayed. It carries the durable fixed cost, and what such a switch took scales it."""
    state = fresh(dwell=0)
    start = decide(observe(4, 80 * GB, work()), state)
    assert start.transition is not None and start.transition.durable_s == 0  # no plan yet: nothing to rebuild
    grow = decide(observe(8, 80 * GB, work()), start.state)
    assert grow.forced and grow.transition is not None and grow.transition.durable_s > 0
    assert grow.transition.seconds >= grow.transition.durable_s
    ran = TransitionTiming(predicted=grow.transition, seconds=3.0 * grow.transition.seconds)
    after = decide(observe(8, 80 * GB, work(), transition=ran), grow.state.model_copy(update={"devices": 8}))
    again = decide(observe(16, 80 * GB, work()), after.state)
    assert again.transition is not None
    # The scales refitted on the switch that ran predict what it took, and price the next one up: its
    # fixed costs (and the checkpoint it writes first, over more devices now) as that switch's were.
    t = after.state.transition_scales
    assert float(np.dot(t.as_array(), grow.transition.terms)) == pytest.approx(
        3.0 * grow.transition.seconds, rel=0.15
    )
    assert max(t.durable, t.recovery) > 2.0  # the larger of its terms took the most
    assert again.transition.seconds > 2.0 * sum(again.transition.terms)


@FAST
@given(mini_batches=st.sampled_from([1, 2, 4, 8]), devices=st.sampled_from([4, 8, 16]))
def test_the_search_obeys_the_mini_batch_rule_the_job_runs_by(mini_batches: int, devices: int) -> None:
    """The plan search knew only the batch, so it could pick a train layout whose replicas
    do not divide batch/mini_batches, which the job then refused. It now asks plan.stage_rows."""
    w = work(batch=16).model_copy(update={"mini_batches": mini_batches})
    d = decide(observe(devices, 80 * GB, w), fresh())
    assert d.plan is not None
    rules = PlanRules(models=fresh().models, devices=devices, batch=16, mini_batches=mini_batches)
    assert problems(d.plan.layouts, rules) == []
