"""Checkpoints kept and bounded, in a running job: an 8-step run with a checkpoint every 2 steps and
``job.keep_checkpoints: 2`` ends holding exactly the two newest complete ones; a failed periodic
checkpoint is tried once more and noted in its step's history line while the run goes on; the resume
point is the newest complete checkpoint, never a half-written one. The failures injected:
tests/support/retention_runs.py. The 30-step run and a real resume: test_checkpoint_retention_long.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

from flows.cli.plan_command import checkpoint_bytes
from flows.job import start as job_start
from nereus_core.config import parse_config
from storage.retention import complete_checkpoints
from storage.run_dir import RunDir
from tests.support.retention_runs import MODELS, retention_config, run_with_failures, steps_on_disk

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

STEPS, EVERY, KEEP, BROKEN = 8, 2, 2, 4
CONFIG = retention_config(steps=STEPS, every=EVERY, keep=KEEP)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return run_with_failures(tmp_path_factory.mktemp("retention") / "run", CONFIG, BROKEN)


def test_the_run_holds_exactly_the_two_newest_complete_checkpoints(run_dir):
    run = RunDir(run_dir)
    assert run.read_summary()["status"] == "completed"
    assert run.checkpoint_steps() == [6, 8] and complete_checkpoints(run_dir) == [6, 8]
    for model in MODELS:  # whole checkpoints went: no snapshot of a deleted step is left
        assert steps_on_disk(run_dir, model) == [6, 8], model


def test_a_failed_periodic_checkpoint_is_retried_once_and_noted_in_its_step(run_dir):
    history = {h["step"]: h for h in RunDir(run_dir).read_rows("metrics/history.parquet")}
    assert sorted(history) == list(range(STEPS))  # the run went on past both failures
    retried = history[EVERY - 1]  # the checkpoint at step 2, written after step 1
    assert retried["checkpoint_attempts"] == 2 and retried["checkpoint_failed"] is False
    assert "No space left on device" in retried["checkpoint_error"]
    failed = history[BROKEN - 1]
    assert failed["checkpoint_attempts"] == 2 and failed["checkpoint_failed"] is True
    assert "Input/output error" in failed["checkpoint_error"]
    assert (history[5]["checkpoint_attempts"], history[5]["checkpoint_failed"]) == (1, False)
    assert history[5]["checkpoint_error"] is None
    assert history[0]["checkpoint_attempts"] is None and history[7]["checkpoint_attempts"] is None


def test_the_resume_point_is_the_newest_complete_checkpoint_not_a_half_written_one(run_dir, tmp_path):
    """The driver died while writing the final checkpoint: its snapshots are committed, its record
    is not. The run resumes from step 6."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    (out / "summary.json").unlink()
    RunDir(out).checkpoint_path(STEPS).unlink()
    assert all(steps_on_disk(out, model) == [6, 8] for model in MODELS)
    assert complete_checkpoints(out) == [6]
    with job_start.opened(parse_config(CONFIG), str(out), None) as (_, _, point):
        assert point is not None and point.step == 6


def test_nereus_plan_counts_the_bytes_a_checkpoint_really_stores(run_dir):
    """``nereus plan``'s figure per model is what the job's snapshots hold: every slice's bytes."""
    predicted = checkpoint_bytes(parse_config(CONFIG))
    assert set(predicted) == set(MODELS)
    for model in MODELS:
        manifest = json.loads((run_dir / "state" / model / f"step={STEPS}" / "manifest.json").read_text())
        stored = sum(s["nbytes"] for f in manifest["files"] for s in f["slices"])
        assert predicted[model] == stored, model
    arrow = sum(p.stat().st_size for p in (run_dir / "state").glob(f"*/step={STEPS}/*.arrow"))
    assert sum(predicted.values()) <= arrow  # the files add Arrow's framing
