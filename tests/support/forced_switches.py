"""A controller told which plan to switch to after which steps, for tests that force a switch the
real controller would not pick on a tiny job (``flows.job.switch.controller_step`` is replaced by it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefect.utilities.annotations import quote

from nereus_core import job
from nereus_core.controller.transition_schedule import move_basis, schedule_moves
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan


def forced_controller(targets: Mapping[int, Mapping[str, Layout]]):
    """``controller_step`` that asks the real controller (its calibration and failures stand), then
    switches to the plan in force with ``targets[step]``'s layouts put in after those steps (its moves
    priced as the controller prices a switch), and keeps it otherwise."""

    def controller_step(state: job.JobState, *, step: int, ready_devices: int | None = None, **seen: Any):
        if isinstance(state, quote):  # the flow quotes it for Prefect's task, which unwraps it
            state = state.unquote()
        obs = job.observation(state, step=step, ready_devices=ready_devices, **seen)
        outcome, decision, state = job.after_step(state, obs)
        change = targets.get(step)
        if isinstance(outcome, job.Fail):
            return outcome, decision, state
        if change is None:
            return job.Keep("kept by the test"), decision, state
        want = GlobalPlan.of({**state.layouts, **change})
        pending = state.controller.model_copy(update={"plan": want, "steps_since_switch": 0})
        reason = f"forced by the test to {want.plan_id}"
        moves = schedule_moves(
            state.plan, want, state.config.models, move_basis(obs, state.controller.settings)
        )
        return job.Switch(want, state.devices, reason, decision, pending, moves), decision, state

    return controller_step
