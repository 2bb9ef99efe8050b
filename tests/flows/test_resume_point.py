"""Where ``nereus resume`` starts: the newest checkpoint; an interrupted switch finished or rolled back."""

from __future__ import annotations

import pytest

from flows.ppo_job import _resume_point
from nereus_core.config import parse_config
from nereus_core.layout import Layout
from storage.journal import START, Journal
from storage.run_dir import RunDir

A = {"actor/train": Layout.contiguous(pp=2), "reference/infer": Layout.contiguous()}
B = {"actor/train": Layout.contiguous(pp=4), "reference/infer": Layout.contiguous(first=3)}


def _dump(plan: dict[str, Layout]) -> dict:
    return {k: v.model_dump(mode="json") for k, v in plan.items()}


@pytest.fixture
def run(tmp_path) -> RunDir:
    cfg = parse_config({"cluster": {"devices": 4}, "job": {"steps": 9, "response_len": 6}})
    run = RunDir.create(tmp_path, cfg.model_dump(mode="json"))
    for step, devices, length in ((2, 2, 6), (5, 4, 12)):
        run.write_checkpoint(
            step, {"plan": _dump(A), "devices": devices, "response_len": length, "plan_id": "a"}
        )
    return run


def _interrupted(run: RunDir, checkpoint_step: int) -> Journal:
    journal = Journal(run.root, "t001-step4")
    journal.record("transition", START, checkpoint_step=checkpoint_step, old=_dump(A), new=_dump(B))
    journal.record("move:actor/train", START)
    return journal


def test_newest_checkpoint_sets_devices_and_response_length(run):
    point, cfg = _resume_point(run, parse_config(run.read_config()), None)
    assert point["step"] == 5 and point["plan"] == A and point["devices"] == 4
    assert cfg.cluster.devices == 4 and cfg.job.response_len == 12


def test_interrupted_switch_from_that_checkpoint_is_finished_on_plan_b(run):
    journal = _interrupted(run, checkpoint_step=5)
    point, _ = _resume_point(run, parse_config(run.read_config()), None)
    assert point["plan"] == B
    assert journal.status() == "committed" and journal.entries()[-1]["finished_by"] == "resume"


def test_switch_that_does_not_fit_the_devices_at_hand_is_rolled_back(run):
    journal = _interrupted(run, checkpoint_step=5)
    point, cfg = _resume_point(run, parse_config(run.read_config()), 2)  # plan B needs slot 3
    assert point["plan"] == A and point["devices"] == 2 and point["record_devices"] == 4
    assert cfg.cluster.devices == 2
    assert journal.status() == "aborted" and journal.entries()[-1]["rolled_back_by"] == "resume"


def test_switch_from_an_older_checkpoint_is_rolled_back(run):
    journal = _interrupted(run, checkpoint_step=2)
    point, _ = _resume_point(run, parse_config(run.read_config()), None)
    assert point["plan"] == A and journal.status() == "aborted"


def test_no_checkpoint_is_one_clear_error(tmp_path):
    run = RunDir.create(tmp_path, parse_config({}).model_dump(mode="json"))
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume from"):
        _resume_point(run, parse_config({}), None)
