"""``nereus run`` and ``nereus resume`` stopped by SIGTERM exit within seconds, leave no process behind
and keep their newest checkpoint as the resume point; the run then resumes to completion."""

from __future__ import annotations

import copy
import signal
import subprocess
from pathlib import Path

import pytest

from storage.run_dir import RunDir
from tests.support.job_configs import FAULT_JOB, SMALL_MODEL
from tests.support.job_runs import CLI, ROOT, cli_env, resume, start_run
from tests.support.processes import descendants, running, stop_and_time, wait_for

STEPS = 8


def _job() -> dict:
    data = copy.deepcopy(FAULT_JOB)
    data.update(name="stop-test", model=dict(SMALL_MODEL))
    data.pop("plan")  # the controller's own plan for 2 slots
    data["cluster"] = {"devices": 2}
    data["job"] = {"steps": STEPS, "batch_size": 8, "prompt_len": 4, "response_len": 6, "snapshot_every": 1}
    return data


def _stop_after_checkpoint(driver: subprocess.Popen, out: Path, step: int, log: Path, what: str) -> float:
    """SIGTERM once the checkpoint of ``step`` is written; checks the exit and that no child is left.
    Returns the seconds from the signal to the exit."""

    def checkpointed() -> bool:
        assert driver.poll() is None, log.read_text()[-3000:]
        return (out / "state" / "checkpoints" / f"step={step}.json").exists()

    try:
        wait_for(f"{what}: checkpoint of step {step}", checkpointed, limit=280, every=0.2)
        kids = descendants(driver.pid)
        seconds = stop_and_time(driver)
    finally:
        if driver.poll() is None:
            driver.kill()
    text = log.read_text()
    print(f"\nnereus {what}: exit {seconds:.1f} s after SIGTERM, {len(kids)} child processes")
    assert driver.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert seconds < 10, text[-3000:]
    wait_for("every child process gone", lambda: not [p for p in kids if running(p)], limit=5, every=0.2)
    last = text.strip().splitlines()[-1]
    assert last.startswith("nereus: stopped by SIGTERM") and f"nereus resume {out}" in last, last
    return seconds


@pytest.mark.slow  # three driver starts: about 4.5 min on a loaded 2-core machine
@pytest.mark.timeout(900)
def test_a_stopped_run_and_resume_continue_from_their_checkpoints(tmp_path: Path) -> None:
    driver, out = start_run(tmp_path, _job())
    _stop_after_checkpoint(driver, out, 1, tmp_path / "driver.log", "run")
    first = RunDir(out).latest_checkpoint()["step"]
    assert 1 <= first < STEPS

    log = tmp_path / "resume.log"
    again = subprocess.Popen(
        [*CLI, "resume", str(out)],
        cwd=ROOT,
        env=cli_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
    )
    _stop_after_checkpoint(again, out, first + 1, log, "resume")
    second = RunDir(out).latest_checkpoint()["step"]
    assert first < second < STEPS

    resume(tmp_path, out)
    summary = RunDir(out).read_summary()
    assert summary["status"] == "completed" and summary["resumed_from_step"] == second
