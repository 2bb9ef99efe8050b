"""nereus_core.controller.history: a measured step's prediction is re-priced exactly under later scales."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus_core.config import Workload
from nereus_core.controller import history
from nereus_core.controller.decide import ControllerSettings, ControllerState, evaluate_plan
from nereus_core.cost.stage_cost import TERMS, Scales
from nereus_core.layout import Layout
from nereus_core.plan import MODEL_STAGES, PPO_STAGES, GlobalPlan, models_for
from tests.support.controller_setup import H100
from tests.support.model_configs import MID

GB = 10**9
PLAN = GlobalPlan(placement="colocated", layouts=dict.fromkeys(MODEL_STAGES, Layout.contiguous(tp=2, dp=4)))
WORK = Workload(batch=64, prompt_len=256, response_mean=512, response_high=1024)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    then=st.lists(st.floats(0.2, 5.0), min_size=len(TERMS), max_size=len(TERMS)),
    now=st.lists(st.floats(0.2, 5.0), min_size=len(TERMS), max_size=len(TERMS)),
    wire=st.floats(0.5, 3.0),
)
def test_a_measurement_is_re_priced_with_the_scales_of_the_day(then, now, wire) -> None:
    """A plan's measured/predicted ratio must not drift when calibration moves after it was measured
    (else a plan left for being slower looks fast again once the scales rise)."""
    state = ControllerState.initial(models_for(MID), H100, ControllerSettings(), stages=PPO_STAGES)
    old = state.model_copy(update={"scales": Scales.from_array(then)})
    kept = history.Pricing(old.scales, 1.0, False).terms(evaluate_plan(PLAN, WORK, old, 72 * GB))
    new = state.model_copy(update={"scales": Scales.from_array(now)})
    wired = new.model_copy(
        update={"transition_scales": new.transition_scales.model_copy(update={"wire": wire})}
    )
    expected = evaluate_plan(PLAN, WORK, wired, 72 * GB).step_s
    assert abs(history.Pricing(wired.scales, wire, False).seconds(PLAN, kept) - expected) <= 1e-9 * expected


def test_the_noise_floor_is_at_least_the_job_s_pooled_noise() -> None:
    """Three steps of a plan that happened to measure alike must not set the noise floor: the
    spread admission reads is at least the noise pooled over every plan's measurements."""
    state = ControllerState.initial(models_for(MID), H100, ControllerSettings(), stages=PPO_STAGES)
    pricing = history.Pricing(state.scales, 1.0, False)
    other = GlobalPlan(
        placement="colocated", layouts=dict.fromkeys(MODEL_STAGES, Layout.contiguous(tp=1, dp=8))
    )
    records: tuple = ()
    for plan, noise in ((other, (0.94, 1.06, 0.97, 1.05, 0.98)), (PLAN, (1.0, 1.001, 0.999))):
        terms = pricing.terms(evaluate_plan(plan, WORK, state, 72 * GB))
        for step, n in enumerate(noise):
            seconds = pricing.seconds(plan, terms) * n
            records = history.remember(
                records,
                plan,
                seconds=seconds,
                predicted=terms,
                workload=WORK,
                devices=8,
                step=step,
                margin=0.2,
            )
    here = history.find(records, PLAN.plan_id, WORK, 8, 0.2)
    own = history.spread(here, pricing)
    pooled = history.spread(here, pricing, records)
    assert own is not None and own < 0.002
    # (0.94 .. 1.06 over 4 degrees of freedom, 3 steps at 1e-3 over 2): about 4 %.
    assert pooled is not None and 0.03 < pooled < 0.05
    assert history.spread(None, pricing, records) is None  # no floor of its own below two steps
