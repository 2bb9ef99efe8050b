"""Where ``nereus resume`` starts: the newest checkpoint; an interrupted switch finished or rolled back."""

from __future__ import annotations

import pytest

from flows.ppo_job import _open_run, _resume_point
from nereus_core.config import ConfigError, parse_config
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


def test_same_config_on_an_unfinished_run_resumes_it(run):
    """What a retry of the failed flow run (same parameters) or a second `nereus run --out` does."""
    cfg = parse_config(run.read_config())
    _, resumed_cfg, point = _open_run(cfg, str(run.root), None)
    assert point is not None and point["step"] == 5 and resumed_cfg.job.response_len == 12


def test_another_config_or_a_completed_run_is_refused(run):
    other = parse_config(run.read_config()).model_copy(update={"name": "other"})
    with pytest.raises(ConfigError, match="unfinished run of another config; continue it with nereus resume"):
        _open_run(other, str(run.root), None)
    run.write_summary({"status": "completed"})
    with pytest.raises(ConfigError, match="already holds a completed run"):
        _open_run(parse_config(run.read_config()), str(run.root), None)


def test_a_new_directory_starts_fresh(tmp_path):
    cfg = parse_config({})
    opened, _, point = _open_run(cfg, str(tmp_path / "new"), 3)
    assert point is None and parse_config(opened.read_config()).cluster.devices == 3
