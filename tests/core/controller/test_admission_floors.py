"""What a move must beat (nereus_core/controller/admission.py, history.py): a plan that ran here
needs only the noise and ``min_measured_gain``, a plan that never ran ``min_gain``; a move, forced
or not, takes a plan that fits the forecast without the choosing margin only when it is much
faster; a record holds while the prompts vary by a few tokens."""

from __future__ import annotations

from nereus_core.controller import history
from nereus_core.controller.admission import Basis, Option, admit, forced
from nereus_core.controller.decide import ControllerSettings, decide, evaluate_plan
from nereus_core.cost.transition_cost import TransitionEstimate
from nereus_core.layout import Layout
from nereus_core.plan import MODEL_STAGES, GlobalPlan
from tests.support.controller_setup import GB, fresh, observe, work

MOVE = TransitionEstimate.of(1.0, 0.0, None, critical_bytes=1, transfers=1, analytic=True)


def _plans():
    state = fresh()
    d = decide(observe(8, 80 * GB, work(batch=16, mean=256)), state)
    bad = GlobalPlan(placement="colocated", layouts=dict.fromkeys(MODEL_STAGES, Layout.contiguous(dp=1)))
    current = evaluate_plan(bad, work(batch=16, mean=256), state, 72 * GB).model_copy(update={"step_s": 20.0})
    return current, d.chosen


def test_a_plan_that_ran_here_needs_only_the_measured_floor() -> None:
    """A 1.2 % gain: refused toward a plan that never ran (under min_gain, 1.5 %, the cost model's
    error), taken toward one whose own measurement here says so (a move that measured slower goes
    back)."""
    current, other = _plans()
    est = other.model_copy(update={"step_s": 19.76})
    kw = dict(current=current, horizon=50, steps_since_switch=10, settings=ControllerSettings())
    predicted = Option(est=est, move=MOVE, ratio=None, left_for=None)
    measured = predicted._replace(ratio=1.0)
    assert admit([predicted], [], basis=Basis(ratio=1.0, spread=0.004), **kw).action == "keep"
    took = admit([measured], [], basis=Basis(ratio=1.0, spread=0.004), **kw)
    assert took.action == "switch" and took.chosen is measured and "(measured)" in took.reason
    # The noise still binds: 2 x 1.5 % spread = 3 % needed.
    assert admit([measured], [], basis=Basis(ratio=1.0, spread=0.015), **kw).action == "keep"
    # Without a spread of its own (fewer than two measurements) the plan in force keeps min_gain.
    assert admit([measured], [], basis=Basis(ratio=1.0), **kw).action == "keep"
    # Among several, one that passes is taken even if one that fails would net more.
    big_unmeasured = Option(
        est=other.model_copy(update={"step_s": 19.72}), move=MOVE, ratio=None, left_for=None
    )
    both = admit([big_unmeasured, measured], [], basis=Basis(ratio=1.0, spread=0.004), **kw)
    assert both.action == "switch" and both.chosen is measured


def test_a_forced_move_takes_a_tight_plan_only_when_it_is_much_faster() -> None:
    """The choosing margin bought a plan 1.7x slower for 67 steps (generation in 16 waves); a plan
    that fits the forecast without the margin is weighed too, but not for a small gain."""
    current, other = _plans()
    lasting = Option(est=other.model_copy(update={"step_s": 30.0}), move=MOVE, ratio=None, left_for=None)
    tight = lasting._replace(est=other.model_copy(update={"step_s": 18.0}), tight=True)
    slightly = lasting._replace(est=other.model_copy(update={"step_s": 29.5}), tight=True)
    kw = dict(current=current, basis=Basis(), horizon=50, usable=72 * GB, tight_gain=0.03)
    assert forced("memory", [lasting, tight], [], **kw).chosen is tight
    assert forced("memory", [lasting, slightly], [], **kw).chosen is lasting
    assert tight.charged_s == 2 * MOVE.seconds and lasting.charged_s == MOVE.seconds
    # Only tight plans fit: one of them, rather than none.
    assert forced("memory", [slightly, tight], [], **kw).chosen is tight


def test_an_unforced_move_takes_a_tight_plan_when_much_faster_and_worth_two_moves() -> None:
    """A plan forced into more generation waves by a peak of the lengths must come back to fewer
    when they fall, though the plan of fewer waves fits them only without the choosing margin; a
    tight plan needs ``min_tight_gain`` and is charged the move out as well."""
    current, other = _plans()  # the plan in force: 20 s a step
    kw = dict(
        current=current, basis=Basis(), horizon=50, steps_since_switch=10, settings=ControllerSettings()
    )
    tight = Option(
        est=other.model_copy(update={"step_s": 15.0}), move=MOVE, ratio=None, left_for=None, tight=True
    )
    took = admit([tight], [], **kw)
    assert took.action == "switch" and took.chosen is tight and "2 moves 2 s (tight)" in took.reason
    # 2 % faster: enough for a lasting plan (min_gain 1.5 %), not for a tight one (min_tight_gain 3 %).
    small = tight._replace(est=other.model_copy(update={"step_s": 19.6}))
    assert admit([small], [], **kw).action == "keep"
    assert admit([small._replace(tight=False)], [], **kw).action == "switch"
    # The second move is charged: a gain that pays for one move over the horizon but not for two.
    dear = TransitionEstimate.of(100.0, 0.0, None, critical_bytes=1, transfers=1, analytic=True)
    pricey = tight._replace(est=other.model_copy(update={"step_s": 17.0}), move=dear)  # 3 s x 50 = 150 s
    assert admit([pricey._replace(tight=False)], [], **kw).action == "switch"  # >= 1.2 x 100 s
    refused = admit([pricey], [], **kw)  # < 1.2 x 200 s
    assert refused.action == "keep" and "1.2 x move 200 s" in refused.alternatives[0].detail


def test_a_record_holds_while_prompts_vary_by_a_few_tokens() -> None:
    """The expected prompt length (a mean over recent steps, rounded) moves by a token on most steps
    of a real trace; exact equality reset every plan's record two steps in three."""
    _, other = _plans()
    record = history.remember(
        (),
        other.plan,
        seconds=20.0,
        predicted=history.Pricing(fresh().scales, 1.0, False).terms(other),
        workload=work(batch=16, prompt=94, mean=256),
        devices=8,
        step=1,
        margin=0.2,
    )
    plan_id = other.plan.plan_id
    assert history.find(record, plan_id, work(batch=16, prompt=96, mean=256), 8, 0.2) is not None
    assert history.find(record, plan_id, work(batch=16, prompt=130, mean=256), 8, 0.2) is None
    assert history.find(record, plan_id, work(batch=16, prompt=94, mean=330), 8, 0.2) is None
