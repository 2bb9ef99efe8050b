"""A 30-step run with a checkpoint every 5 steps and ``job.keep_checkpoints: 2`` (the failures of
tests/support/retention_runs.py injected at steps 5 and 15) ends holding exactly the checkpoints of
steps 25 and 30, and a real resume of it starts from the newest complete one."""

from __future__ import annotations

import shutil

import pytest

from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from storage.retention import complete_checkpoints
from storage.run_dir import RunDir
from tests.support.retention_runs import MODELS, retention_config, run_with_failures, steps_on_disk

pytestmark = [
    pytest.mark.usefixtures("prefect_server"),  # the flows run against the suite's one Prefect server
    pytest.mark.slow,  # 32 s for the run and 12 s for the resume on an idle 2-core machine, 100 s loaded
]

STEPS, EVERY, KEEP, BROKEN = 30, 5, 2, 15
CONFIG = retention_config(steps=STEPS, every=EVERY, keep=KEEP)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return run_with_failures(tmp_path_factory.mktemp("retention-long") / "run", CONFIG, BROKEN)


def test_thirty_steps_leave_exactly_the_two_newest_complete_checkpoints(run_dir):
    run = RunDir(run_dir)
    assert run.read_summary()["status"] == "completed"
    assert run.checkpoint_steps() == [25, 30] and complete_checkpoints(run_dir) == [25, 30]
    for model in MODELS:
        assert steps_on_disk(run_dir, model) == [25, 30], model
    history = {h["step"]: h for h in run.read_rows("metrics/history.parquet")}
    assert sorted(history) == list(range(STEPS))
    assert [s for s, h in history.items() if h["checkpoint_attempts"] == 2] == [EVERY - 1, BROKEN - 1]
    assert [s for s, h in history.items() if h["checkpoint_failed"]] == [BROKEN - 1]


def test_a_resume_starts_from_the_newest_complete_checkpoint_not_a_half_written_one(run_dir, tmp_path):
    """The driver died while writing the final checkpoint: its snapshots are committed, its record
    is not. The resume starts from step 25, writes step 30 anew and keeps the two newest."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    (out / "summary.json").unlink()
    RunDir(out).checkpoint_path(STEPS).unlink()
    assert complete_checkpoints(out) == [25] and RunDir(out).latest_checkpoint()["step"] == 25
    rl_job(config=parse_config(CONFIG), out_dir=str(out))
    summary = RunDir(out).read_summary()
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 25
    assert summary["steps"] == STEPS and RunDir(out).identity().incarnation == 1
    assert RunDir(out).checkpoint_steps() == [25, 30] and complete_checkpoints(out) == [25, 30]
    for model in MODELS:
        assert steps_on_disk(out, model) == [25, 30], model
