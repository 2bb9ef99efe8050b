"""tasks/controller.py: the controller task builds what the controller sees from the step it is given."""

from __future__ import annotations

import pytest

from nereus_core import job
from tasks import controller
from tests.core.test_job import cramped


def test_the_controller_task_builds_its_observation_from_the_step_and_what_was_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = []
    monkeypatch.setattr(
        controller, "after_step", lambda state, obs: seen.append(obs) or job.after_step(state, obs)
    )
    state = cramped()
    rows = [{"model": "actor", "stage": "train", "duration_s": 0.5}]
    outcome, decision, _ = controller.controller_step.fn(
        state, step=3, ready_devices=2, rows=rows, lengths=[4, 6, 6, 8], memory_peaks={0: 5}
    )
    (obs,) = seen
    assert obs == job.observation(
        state, step=3, rows=rows, lengths=[4, 6, 6, 8], memory_peaks={0: 5}, ready_devices=2
    )
    assert obs.timings[0].layout == state.layouts["actor/train"] and obs.ready_devices == 2
    # The decision comes back ready to carry out: plan B with the schedule it was priced on.
    assert isinstance(outcome, job.Switch) and outcome.moves is decision.moves is not None
