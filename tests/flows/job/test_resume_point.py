"""Where ``nereus resume`` starts: the newest checkpoint; an interrupted switch finished or rolled back."""

from __future__ import annotations

import pytest

from flows.job.start import initial_state, opened
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


def _resume(run: RunDir, devices: int | None = None):
    """The resume point ``opened`` finds and the config as the job resumes on it (``initial_state``)."""
    with opened(parse_config(run.read_config()), str(run.root), devices) as (opened_run, cfg, point):
        return point, initial_state(opened_run, cfg, point).config


def test_newest_checkpoint_sets_devices_and_response_length(run):
    incarnation = run.identity().incarnation
    point, cfg = _resume(run)
    assert point.step == 5 and point.layouts == A and point.devices == 4
    assert cfg.cluster.devices == 4 and cfg.job.response_len == 12
    assert run.identity().incarnation == incarnation + 1  # a new driver took the run over


def test_interrupted_switch_from_that_checkpoint_is_finished_on_plan_b(run):
    journal = _interrupted(run, checkpoint_step=5)
    point, _ = _resume(run)
    assert point.layouts == B
    assert journal.status() == "committed" and journal.entries()[-1]["finished_by"] == "resume"


def test_switch_that_does_not_fit_the_devices_at_hand_is_rolled_back(run):
    journal = _interrupted(run, checkpoint_step=5)
    point, cfg = _resume(run, 2)  # plan B needs slot 3
    assert point.layouts == A and point.devices == 2 and point.checkpoint_devices == 4
    assert cfg.cluster.devices == 2
    assert journal.status() == "aborted" and journal.entries()[-1]["rolled_back_by"] == "resume"


def test_switch_from_an_older_checkpoint_is_rolled_back(run):
    journal = _interrupted(run, checkpoint_step=2)
    point, _ = _resume(run)
    assert point.layouts == A and journal.status() == "aborted"


def test_a_completed_run_is_refused(run):
    run.write_summary({"status": "completed"})
    with pytest.raises(ConfigError, match="already holds a completed run"):
        _resume(run)


def test_no_checkpoint_starts_a_new_run(tmp_path):
    cfg = parse_config({})
    old = RunDir.create(tmp_path, cfg.model_dump(mode="json")).identity().run_id
    with opened(cfg, str(tmp_path), None) as (run, _, point):
        assert point is None and run.identity().run_id != old


def test_same_config_on_an_unfinished_run_resumes_it(run):
    """What a retry of the failed flow run (same parameters) or a second `nereus run --out` does."""
    point, resumed_cfg = _resume(run)
    assert point is not None and point.step == 5 and resumed_cfg.job.response_len == 12


def test_another_config_is_refused(run):
    other = parse_config(run.read_config()).model_copy(update={"name": "other"})
    refused = pytest.raises(
        ConfigError, match="unfinished run of another config; continue it with nereus resume"
    )
    with refused, opened(other, str(run.root), None):
        pass


def test_a_new_directory_starts_fresh(tmp_path):
    with opened(parse_config({}), str(tmp_path / "new"), 3) as (run, _, point):
        assert point is None and parse_config(run.read_config()).cluster.devices == 3


def test_a_second_driver_on_a_live_run_is_refused(run):
    from storage.lock import RunLocked

    cfg = parse_config(run.read_config())
    locked = pytest.raises(RunLocked, match="is in use by pid")
    with opened(cfg, str(run.root), None), locked, opened(cfg, str(run.root), None):
        pass
