"""nereus_core.job: the job's state machine, without a pool, Prefect or files.

The drift tests reproduce the bug: the controller stored plan B before anything ran, so a
refused, aborted or GTG-refused switch left it believing in a plan the job did not run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from nereus_core import job as job_rules
from nereus_core.config import NereusConfig, ScenarioEvent, parse_config
from nereus_core.controller import probe
from nereus_core.controller.decide import decide
from nereus_core.controller.moves import MoveBasis
from nereus_core.controller.state import ProbeTiming
from nereus_core.controller.transition_schedule import priced_moves
from nereus_core.cost.stage_cost import estimate
from nereus_core.layout import Layout
from nereus_core.plan import MODEL_STAGES, GlobalPlan, plan_id

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_ppo.yaml"


def demo(**job: object) -> NereusConfig:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["job"].update(scenario=[], **job)
    return parse_config(data)


def cramped() -> job_rules.JobState:
    """The demo started with every model-stage on slot 0 of 2: more than a 64 MiB slot holds with
    12-token responses (96.5 MiB), so the controller must move (a forced switch, whatever the timings)."""
    cfg = demo(response_len=12)
    return job_rules.start(cfg, dict.fromkeys(MODEL_STAGES, Layout.contiguous()))


def test_start_fills_the_plan_and_the_controller_starts_on_it() -> None:
    state = job_rules.start(demo())
    assert set(state.layouts) == set(MODEL_STAGES)
    assert state.controller.plan == GlobalPlan.of(state.layouts)
    assert state.plan_id == plan_id(state.layouts) == state.controller.plan.plan_id
    assert state.devices == 2 and state.aliased == frozenset({"actor/generate", "critic/infer"})


def test_a_needed_switch_is_asked_for_and_only_commit_moves_the_controller() -> None:
    state = cramped()
    outcome, decision, state = job_rules.after_step(state, job_rules.observation(state, step=0))
    assert isinstance(outcome, job_rules.Switch) and decision.forced
    assert state.controller.plan == GlobalPlan.of(state.layouts)  # still plan A: nothing ran yet
    after = job_rules.commit(state, outcome, "committed")
    assert after.layouts == outcome.layouts and after.plan_id == outcome.plan_id
    assert after.controller.plan == GlobalPlan.of(outcome.layouts)
    assert after.controller.steps_since_switch == 0


def test_a_switch_carries_the_move_schedule_the_controller_priced() -> None:
    """The switch's moves are the very schedule behind the decision's price (one object, never planned
    again), on the pool the observation described: the transition re-checks that pool and runs them."""
    state = cramped()
    obs = job_rules.observation(state, step=0)
    outcome, decision, _ = job_rules.after_step(state, obs)
    assert isinstance(outcome, job_rules.Switch) and outcome.devices == state.devices
    moves = outcome.moves
    assert moves is not None and moves is decision.moves
    assert moves.old == state.plan and moves.new == outcome.plan
    assert moves.basis == MoveBasis(slots=2, memory_per_device=obs.memory_per_device)
    c = state.controller
    settings = {"recovery": c.settings.switch_recovery, "verify": c.settings.verify_transitions}
    estimate, again = priced_moves(
        state.plan, outcome.plan, c.models, c.profile, basis=moves.basis, **settings
    )
    assert again is moves and decision.transition is not None
    assert estimate.terms == decision.transition.terms


@pytest.mark.parametrize("status", ["aborted", "refused"])
def test_an_aborted_or_gtg_refused_switch_leaves_job_and_controller_on_plan_a(status: str) -> None:
    state = cramped()
    plan_a = state.plan_id
    outcome, _, state = job_rules.after_step(state, job_rules.observation(state, step=0))
    assert isinstance(outcome, job_rules.Switch)
    after = job_rules.commit(state, outcome, status)  # type: ignore[arg-type]
    assert after.plan_id == plan_a and after.controller.plan.plan_id == plan_a
    # The controller knows it is still on plan A, so it asks again after the next step.
    again, _, _ = job_rules.after_step(after, job_rules.observation(after, step=1))
    assert isinstance(again, job_rules.Switch) and again.plan_id == outcome.plan_id


def test_a_plan_the_job_cannot_run_is_refused_and_the_controller_stays_on_plan_a(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = cramped()
    plan_a = state.plan_id

    def bad_switch(obs, controller):  # the controller proposes a plan the config's rules refuse
        d = decide(obs, controller)
        bad = dict(d.plan.layouts, **{"actor/train": Layout.contiguous(tp=3)})
        return d.model_copy(update={"state": d.state.model_copy(update={"plan": GlobalPlan.of(bad)})})

    monkeypatch.setattr(job_rules, "decide", bad_switch)
    monkeypatch.setattr(job_rules, "problems", lambda layouts, rules: ["actor/train: tp=3 does not divide"])
    outcome, _, after = job_rules.after_step(state, job_rules.observation(state, step=0))
    assert isinstance(outcome, job_rules.Keep) and "refused" in outcome.reason
    assert after.plan_id == plan_a and after.controller.plan.plan_id == plan_a


def test_keep_advances_the_calibration_but_not_the_plan() -> None:
    state = job_rules.start(demo())
    rows = [{"model": "actor", "stage": "generate", "duration_s": 0.2}]
    outcome, _, after = job_rules.after_step(state, job_rules.observation(state, step=0, rows=rows))
    if isinstance(outcome, job_rules.Keep):
        assert after.plan_id == state.plan_id and len(after.controller.samples) == 1
    else:  # the controller may prefer another plan: it is pending, not in force
        assert after.controller.plan == state.controller.plan


def test_a_device_change_is_a_switch_to_a_new_world_and_fails_loudly_if_not_committed() -> None:
    state, what = job_rules.apply_event(job_rules.start(demo()), ScenarioEvent(step=3, devices=4))
    assert what == ["devices 2 -> 4"] and state.devices == 2 and state.config.cluster.devices == 4
    outcome, _, state = job_rules.after_step(state, job_rules.observation(state, step=2))
    assert isinstance(outcome, job_rules.Switch) and outcome.devices == 4
    assert job_rules.commit(state, outcome, "committed").devices == 4
    with pytest.raises(job_rules.JobFailed, match="device set changed"):
        job_rules.commit(state, outcome, "aborted")


def test_no_plan_fits_fails_with_a_reason() -> None:
    state = job_rules.start(demo())
    cluster = state.config.cluster.model_copy(update={"memory_per_device": 1024})
    state = replace(state, config=state.config.model_copy(update={"cluster": cluster}))
    outcome, _, _ = job_rules.after_step(state, job_rules.observation(state, step=0))
    assert isinstance(outcome, job_rules.Fail) and "more devices or memory" in outcome.reason


def test_the_observation_prices_the_job_that_runs() -> None:
    state = job_rules.start(demo())
    obs = job_rules.observation(state, step=3, lengths=[4, 6, 6, 8], memory_peaks={0: 5})
    assert obs.workload.ppo_epochs == 2 and obs.workload.mini_batches == 2  # the demo trains 2 x 2
    assert obs.workload.response_mean == 6.0 and obs.workload.response_high >= 6
    assert obs.memory_peaks == {0: 5} and obs.remaining_steps == state.config.job.steps - 4
    assert job_rules.observation(state, step=0).workload.response_mean == state.config.job.response_len


def test_stage_timings_keep_only_priced_model_stages() -> None:
    state = job_rules.start(demo())
    rows = [
        {"model": "actor", "stage": "train", "duration_s": 1.0},
        {"model": "actor", "stage": "infer", "duration_s": 0.1},  # old log-probs: not a model-stage
        {"model": "task", "stage": "rule_score", "duration_s": 0.01},
        {"model": "critic", "stage": "infer", "duration_s": 0.0},  # aliased: nothing ran
    ]
    assert [t.stage for t in job_rules.stage_timings(rows, state.layouts)] == ["actor/train"]


def test_resume_point_finishes_a_switch_that_fits_and_rolls_back_the_rest() -> None:
    a = {s: Layout.contiguous(dp=2).model_dump(mode="json") for s in MODEL_STAGES}
    b = {s: Layout.contiguous(dp=4).model_dump(mode="json") for s in MODEL_STAGES}
    record = {"step": 10, "plan": a, "devices": 2, "response_len": 6}
    headers = {"t1": {"checkpoint_step": 10, "new": b}, "t0": {"checkpoint_step": 5, "new": b}}
    point = job_rules.resume_point(record, headers, devices=4)
    assert point.journals == {"t1": "finish", "t0": "roll_back"}
    assert point.layouts["actor/train"].dp == 4 and point.devices == 4 and point.replan
    stay = job_rules.resume_point(record, headers, devices=None)  # plan B needs 4 slots, 2 at hand
    assert stay.journals == {"t1": "roll_back", "t0": "roll_back"} and not stay.replan


def test_resumed_on_other_devices_replans_for_them() -> None:
    cfg = demo()
    record = {
        "step": 10,
        "plan": {s: v.model_dump(mode="json") for s, v in job_rules.start(cfg).layouts.items()},
    }
    point = job_rules.resume_point({**record, "devices": 2, "response_len": 6}, {}, devices=4)
    state = job_rules.resumed(cfg, point)
    assert state.devices == 4 and state.config.cluster.devices == 4
    assert max(max(v.devices) for v in state.layouts.values()) < 4
    assert state.controller.plan == GlobalPlan.of(state.layouts)


def test_the_controller_sees_the_real_prompt_tokens_and_memory_their_longest() -> None:
    """After a step the workload's prompt length is the mean of the real prompt tokens (the config's
    is the padded width) and its longest prompt is what memory holds; before any step, the config's."""
    state = job_rules.start(demo())
    before = job_rules.observation(state, step=0).workload
    assert (before.prompt_len, before.prompt_longest) == (state.config.job.prompt_len,) * 2
    seen = job_rules.observation(state, step=0, lengths=[4, 6], prompt_lengths=[3, 4, 9, 4]).workload
    assert (seen.prompt_len, seen.prompt_high) == (5, 9)
    layout, model = Layout.contiguous(), state.config.models["actor"]
    # Generation's cache, and a padded pass's rows, hold the longest prompt (a packed pass its real tokens).
    padded = seen.model_copy(update={"pack": False})
    for stage, work in (("actor/generate", seen), ("actor/train", padded)):
        mean_only = work.model_copy(update={"prompt_high": None})
        held = estimate(stage, layout, work, model, state.controller.profile).memory.activations
        assert held > estimate(stage, layout, mean_only, model, state.controller.profile).memory.activations


def test_the_job_asks_for_probes_and_the_next_decision_calibrates_on_their_timings() -> None:
    """The job's controller asks for probes at the TP degrees its plan's slots allow (the runtime runs
    them: tasks/probes.py); the timings the flow puts in the state reach the next observation, become
    calibration samples, and are gone after."""
    state = job_rules.start(demo())
    _, decision, state = job_rules.after_step(state, job_rules.observation(state, step=0))
    # The demo's first decision takes a plan of one slot per stage: no TP degree to probe there.
    assert all(len(v.devices) == 1 for v in decision.plan.layouts.values()) and decision.probes == ()
    # On the start plan's two slots the probes are due, for the stages they cover.
    start = GlobalPlan.of(job_rules.start(demo()).layouts)
    asked = probe.requests(start, job_rules.observation(state, step=1).workload, state.controller)
    assert asked and {p.stage for p in asked} <= {"actor/generate", "actor/train"}
    timed = tuple(ProbeTiming(request=p, seconds=0.01) for p in asked)
    seen = job_rules.observation(replace(state, probes=timed), step=1)
    assert seen.probes == timed
    before = len(state.controller.samples)
    _, next_decision, after = job_rules.after_step(replace(state, probes=timed), seen)
    assert len(next_decision.state.samples) == before + len(timed) and after.probes == ()
