"""A device worker stopped (SIGSTOP: as a frozen process or a deadlocked kernel looks from outside)
in the middle of ``nereus run``: the step fails by its call's deadline with one line naming the
worker and its pid, the driver exits instead of waiting for ever, and ``nereus resume`` continues
from the newest checkpoint on new workers to the end, every step recorded once."""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from storage.run_dir import RunDir
from tests.support.job_configs import FAULT_JOB
from tests.support.job_runs import CLI, ROOT, cli_env, resume
from tests.support.processes import kill_session, wait_for

pytestmark = pytest.mark.usefixtures("prefect_server")  # the CLI runs against the suite's Prefect server

DEADLINE_S = 30  # every device call's deadline here: the demo's calls take well under a second
STEPS = 8  # a step takes ~0.3 s here (and its checkpoint about as long): stopped well before the end


def _workers(driver: subprocess.Popen) -> dict[str, psutil.Process]:
    """The driver's Dask worker processes by address (their title: ``dask worker [ADDRESS]``)."""
    out = {}
    for proc in psutil.Process(driver.pid).children():
        with contextlib.suppress(psutil.Error):
            title = " ".join(proc.cmdline())
            if title.startswith("dask worker ["):
                out[title.split("[")[1].split("]")[0]] = proc
    return out


@pytest.mark.timeout(900)
@pytest.mark.slow  # about 200 s on two busy cores: a run to its checkpoint of step 2, a hang, a resume
def test_a_stopped_worker_fails_the_step_by_its_deadline_and_resume_completes(tmp_path: Path) -> None:
    data = copy.deepcopy(FAULT_JOB)
    data["cluster"]["devices"] = 2
    data["job"].update(steps=STEPS, snapshot_every=1, scenario=[])
    data["plan"]["reference/infer"] = {"devices": [0]}
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(data))
    out = tmp_path / "run"
    deadline = [f"cluster.call_timeout_s={DEADLINE_S}", "cluster.call_timeout_s_per_token=0"]
    log = tmp_path / "driver.log"
    driver = subprocess.Popen(
        [*CLI, "run", str(config), "--out", str(out), *(a for s in deadline for a in ("--set", s))],
        cwd=ROOT,
        env=cli_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
    )
    stopped: list[psutil.Process] = []
    try:
        wait_for("the workers", lambda: len(_workers(driver)) == 2, 300, 0.2)
        address, worker = sorted(_workers(driver).items())[-1]
        ready = out / "state" / "checkpoints" / "step=2.json"
        wait_for("the checkpoint of step 2", lambda: ready.exists() or driver.poll() is not None, 400, 0.05)
        assert driver.poll() is None, log.read_text()[-2000:]
        worker.suspend()  # SIGSTOP
        stopped.append(worker)
        started = time.monotonic()

        def named() -> list[str]:
            return [
                x for x in log.read_text().splitlines() if f"pid {worker.pid}" in x and "gave no answer" in x
            ]

        # The call in flight when the worker stopped began before it: its deadline ends within
        # DEADLINE_S; the gather polls every 2 s, and two busy cores add their share.
        failed_s = wait_for("the line naming the stopped worker", lambda: bool(named()), DEADLINE_S + 20, 0.2)
        driver.wait(timeout=120)  # the flow ends, the pool closes, the driver exits: nothing waits for ever
        exited_s = time.monotonic() - started
        line = named()[0]
        assert driver.returncode not in (0, None), log.read_text()[-2000:]
        assert f"(worker {address}, pid {worker.pid}, its process is stopped)" in line, line
        assert f"within its {DEADLINE_S}s deadline" in line and "raise cluster.call_timeout_s" in line, line
        print(f"\nnamed {failed_s:.0f} s and exited {exited_s:.0f} s after the stop: {line}")
        assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE  # killed
    finally:
        for proc in stopped:
            with contextlib.suppress(psutil.Error):
                proc.resume()
                proc.kill()
        kill_session(driver)

    resume(tmp_path, out)  # new workers, from the newest checkpoint
    summary = RunDir(out).read_summary()
    assert summary["status"] == "completed" and summary["resumed_from_step"] >= 2
    rows = pq.read_table(out / "metrics" / "steps.parquet").to_pylist()
    keys = [(r["step"], r["model"], r["stage"]) for r in rows]
    assert sorted({k[0] for k in keys}) == list(range(STEPS))
    assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]
