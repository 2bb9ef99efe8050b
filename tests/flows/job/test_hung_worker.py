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


def _workers(driver: subprocess.Popen) -> list[psutil.Process]:
    """The driver's Dask worker processes (its LocalCluster's nannies live in the driver itself)."""
    out = []
    for proc in psutil.Process(driver.pid).children():
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(proc.cmdline()):
                out.append(proc)
    return out


@pytest.mark.timeout(900)
@pytest.mark.slow  # about 150 s on two cores: a run to its first checkpoint, a hang, a resume
def test_a_stopped_worker_fails_the_step_by_its_deadline_and_resume_completes(tmp_path: Path) -> None:
    data = copy.deepcopy(FAULT_JOB)
    data["cluster"]["devices"] = 2
    data["job"].update(steps=4, snapshot_every=1, scenario=[])
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
        ready = out / "state" / "checkpoints" / "step=1.json"
        wait_for("the checkpoint of step 1", lambda: ready.exists() or driver.poll() is not None, 400, 0.1)
        assert driver.poll() is None, log.read_text()[-2000:]
        worker = _workers(driver)[-1]
        worker.suspend()  # SIGSTOP
        stopped.append(worker)
        started = time.monotonic()
        driver.wait(timeout=DEADLINE_S + 120)  # the hung call, then the flow's end and the pool's close
        elapsed = time.monotonic() - started
        text = log.read_text()
        assert driver.returncode not in (0, None), text[-2000:]
        (line,) = [x for x in text.splitlines() if f"pid {worker.pid}" in x and "gave no answer" in x][:1]
        assert f"within its {DEADLINE_S}s deadline" in line and "its process is stopped" in line, line
        assert "device slot " in line and "(worker tcp://127.0.0.1:" in line, line
        print(f"\nthe driver exited {elapsed:.0f} s after the worker was stopped: {line}")
        assert elapsed < DEADLINE_S + 120
        assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE  # killed
    finally:
        for proc in stopped:
            with contextlib.suppress(psutil.Error):
                proc.resume()
                proc.kill()
        kill_session(driver)

    resume(tmp_path, out)  # new workers, from the newest checkpoint
    summary = RunDir(out).read_summary()
    assert summary["status"] == "completed" and summary["resumed_from_step"] >= 1
    rows = pq.read_table(out / "metrics" / "steps.parquet").to_pylist()
    keys = [(r["step"], r["model"], r["stage"]) for r in rows]
    assert sorted({k[0] for k in keys}) == [0, 1, 2, 3]
    assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]
