"""A controller told which plan to switch to after which steps, for tests that force a switch the
real controller would not pick on a tiny job (``rl_job.controller_step`` is replaced by it)."""

from __future__ import annotations

from collections.abc import Mapping

from nereus_core import job
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan, plan_id


def forced_controller(targets: Mapping[int, Mapping[str, Layout]]):
    """``controller_step`` that asks the real controller (its calibration and failures stand), then
    switches to the plan in force with ``targets[step]``'s layouts put in after those steps, and keeps
    it otherwise."""

    def controller_step(state: job.JobState, obs):
        outcome, decision, state = job.after_step(state, obs)
        change = targets.get(obs.step)
        if isinstance(outcome, job.Fail):
            return outcome, decision, state
        if change is None:
            return job.Keep("kept by the test"), decision, state
        want = {**state.layouts, **change}
        pending = state.controller.model_copy(update={"plan": GlobalPlan.of(want), "steps_since_switch": 0})
        reason = f"forced by the test to {plan_id(want)}"
        return job.Switch(dict(want), state.devices, reason, decision, pending), decision, state

    return controller_step
