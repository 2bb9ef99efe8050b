"""A GRPO job on vLLM (``nereus run`` in a process of its own) whose engine process is stopped
(SIGSTOP: alive and silent, as a deadlocked kernel or a full pipe leaves it; the workers and the
flow's heartbeat go on) once the step-1 checkpoint is written:

- the engine is killed within its request's deadline (small deadlines given with ``--set``) and the run
  exits non-zero with one line naming the engine, its model-stage, its pid and the deadline;
- ``nereus resume`` starts new engines from the newest checkpoint and completes, every step present
  exactly once in the run's metrics.

Slow: two drivers, each starting a Dask pool and a vLLM engine, about two to four minutes here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from nereus_core.config import vllm_installed
from storage.run_dir import RunDir
from tests.support.job_runs import CLI, ROOT, cli_env, resume
from tests.support.model_configs import VLLM_JOB_MODEL
from tests.support.processes import descendants, kill_session, running

pytestmark = [
    pytest.mark.usefixtures("prefect_server"),  # the drivers run against the suite's one Prefect server
    pytest.mark.skipif(
        not vllm_installed(), reason="vLLM is not installed (pip install -e '.[vllm]' or make install-vllm)"
    ),
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

STEPS = 3
DEADLINE_S = 20.0  # a healthy tiny engine answers a generate or a reload in well under a second
MODEL = VLLM_JOB_MODEL
CONFIG = {
    "name": "grpo-vllm-stopped",
    "cluster": {"devices": 2, "memory_per_device": "512MiB"},
    "model": MODEL,
    "job": {"steps": STEPS, "batch_size": 8, "prompt_len": 4, "response_len": 6, "snapshot_every": 1},
    "algorithm": {"name": "grpo", "group_size": 4},
    "ppo": {"kl_coef": 0.0, "use_kl_loss": False, "ppo_epochs": 1, "mini_batches": 2, "actor_lr": 1e-2},
    "rollout": {"engine": "vllm", "kv_cache_memory_bytes": "32MiB", "max_num_seqs": 64},
    "plan": {"actor/generate": {"devices": [0]}, "actor/train": {"dp": 2, "devices": [0, 1]}},
}
SETS = [
    f"rollout.generate_timeout_s={DEADLINE_S}",
    "rollout.generate_timeout_s_per_token=0",
    f"rollout.sync_timeout_s={DEADLINE_S}",
    "rollout.sync_timeout_s_per_gib=0",
]


def _engine_process(driver: subprocess.Popen) -> psutil.Process | None:
    for proc in descendants(driver.pid):
        try:
            if "tasks.runtime.vllm_host" in " ".join(proc.cmdline()):
                return proc
        except psutil.Error:
            continue
    return None


def _stop_engine_after_checkpoint(driver: subprocess.Popen, out: Path, log: Path) -> psutil.Process:
    """SIGSTOP the driver's engine process as soon as the step-1 checkpoint is complete."""
    ready = out / "state" / "checkpoints" / "step=1.json"
    limit = time.monotonic() + 400
    while not ready.exists() and driver.poll() is None and time.monotonic() < limit:
        time.sleep(0.05)
    engine = _engine_process(driver) if ready.exists() else None
    assert engine is not None, log.read_text()[-3000:]
    engine.send_signal(signal.SIGSTOP)
    return engine


def test_a_stopped_engine_fails_the_step_within_its_deadline_and_resume_completes(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(CONFIG))
    out, log = tmp_path / "run", tmp_path / "driver.log"
    sets = [arg for s in SETS for arg in ("--set", s)]
    driver = subprocess.Popen(
        [*CLI, "run", str(config), "--out", str(out), *sets],
        cwd=ROOT,
        env=cli_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),  # a pipe would stay open in its orphans
        start_new_session=True,
    )
    engine = None
    try:
        engine = _stop_engine_after_checkpoint(driver, out, log)
        stopped = time.monotonic()
        while running(engine) and time.monotonic() - stopped < DEADLINE_S + 60:
            time.sleep(0.1)
        killed = time.monotonic() - stopped
        driver.wait(timeout=180)  # the pool and the flow run close after the failed step
        exited = time.monotonic() - stopped
    finally:
        if engine is not None and running(engine):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                os.kill(engine.pid, sig)
        kill_session(driver)
    lines = [line for line in log.read_text().splitlines() if line.startswith("nereus:")]
    print(f"engine killed {killed:.1f} s after its stop, the driver exited after {exited:.1f} s: {lines}")
    assert driver.returncode not in (0, None) and lines, log.read_text()[-3000:]
    last = lines[-1]
    assert f"vLLM engine of actor/generate replica 0 (device 0) (pid {engine.pid})" in last, last
    assert f"within its deadline of {DEADLINE_S:.1f} s" in last and f"nereus resume {out}" in last, last
    # the request in flight when it stopped, or the next one, hit the deadline and killed it
    assert killed < DEADLINE_S + 15, killed
    assert not running(engine)

    resume(tmp_path, out)
    run = RunDir(out)
    summary = run.read_summary()
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 1, summary
    assert [h["step"] for h in run.read_rows("metrics/history.parquet")] == list(range(STEPS))
    rows = pq.read_table(out / "metrics" / "steps.parquet").to_pylist()
    generated = [r["step"] for r in rows if (r["model"], r["stage"]) == ("actor", "generate")]
    assert sorted(generated) == list(range(STEPS)), generated  # every step's generation once
