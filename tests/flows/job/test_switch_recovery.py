"""What a live switch writes before it moves anything, by ``job.switch_recovery``.

The job: the demo's model on 4 slots, a response-length event before step 1 that forces a live switch
(tests/support/job_configs.py's FAULT_JOB), no periodic checkpoint but the final one, the switch
verified against live digests.

- ``async``: every model's state at step 1 is staged in host memory (the model-stages the one-wave
  live move keeps: written from their old shards as they are) and written while the job goes on:
  the checkpoint of step 1 is complete only after the transition committed, and it holds plan A's
  state, the state that generated rollout 1 (transformers on the actor read back from it gives the
  log-probs the job stored);
- ``none``: nothing is written: no checkpoint of step 1 at all.

In both, the switch is verified bitwise against the digests read from the devices before the moves
(no checkpoint was read for it), and the transitions table shows every part of its seconds.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from storage.journal import journals
from storage.run_dir import RunDir
from tests.support.job_configs import FAULT_JOB
from tests.support.job_runs import assert_rollout_made_by_checkpoint, plans_by_step

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> Path:
    data = copy.deepcopy(FAULT_JOB)
    data["job"].update(snapshot_every=0, verify_transitions=True, switch_recovery=mode)
    monkeypatch.setenv("NEREUS_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    rl_job(config=parse_config(data), out_dir=str(out))
    return out


def _switch_row(out: Path) -> dict:
    (row,) = pq.read_table(out / "metrics" / "transitions.parquet").to_pylist()
    assert row["status"] == "committed" and row["route"] == "live" and row["verified_bitwise"]
    parts = row["recovery_s"] + row["verify_s"] + row["moves_s"]
    assert 0 < parts <= row["actual_s"] + 1e-9  # the rest: the controller's call and the records
    assert row["predicted_recovery_s"] >= 0 and row["predicted_verify_s"] > 0
    return row


@pytest.mark.timeout(600)
def test_an_async_switch_writes_its_recovery_point_after_the_moves(tmp_path, monkeypatch):
    out = _run(tmp_path, monkeypatch, "async")
    run = RunDir(out)
    assert run.read_summary()["status"] == "completed"
    row = _switch_row(out)
    assert row["recovery"] == "async" and row["predicted_recovery_s"] > 0
    # One wave of live moves: the model-stages it moved were written from their kept old shards,
    # with no copy, and the checkpoint still holds plan A's state (below).
    assert row["staged_in_place"] and set(row["staged_in_place"].split(",")) <= {
        "actor/train",
        "critic/train",
        "reference/infer",
        "reward/infer",
    }
    plans = plans_by_step(out)
    assert plans[1] != plans[0]  # plan B from step 1 on
    # The checkpoint of step 1 was completed after the transition committed, not before it moved.
    (journal,) = [j for j in journals(out) if j.transition_id.startswith("t000")]
    committed = [e["t"] for e in journal.entries() if e["op"] == "transition" and e["phase"] == "commit"]
    assert committed and run.checkpoint_path(1).stat().st_mtime > committed[0]
    record = run.read_checkpoint(1)
    assert record["plan_id"] == plans[0] and set(record["live_digests"]) == {
        "actor",
        "critic",
        "reference",
        "reward",
    }
    assert run.checkpoint_steps() == [1, 3]
    assert_rollout_made_by_checkpoint(out, 1, tmp_path)  # it holds the state that generated step 1
    # Probes are due at the TP degrees the decided plan's slots allow: plan B runs actor/train and
    # generation on one slot each (recomputing, it fits), so the decision asked none and none ran.
    plan_b = json.loads((out / "plans" / f"{plans[1]}.json").read_text())
    assert len(plan_b["actor/train"]["devices"]) == len(plan_b["actor/generate"]["devices"]) == 1
    assert not any(r.get("probe_s") for r in run.read_rows("metrics/history.parquet"))


@pytest.mark.timeout(600)
def test_a_switch_without_a_recovery_point_writes_nothing_and_is_verified_live(tmp_path, monkeypatch):
    out = _run(tmp_path, monkeypatch, "none")
    run = RunDir(out)
    assert run.read_summary()["status"] == "completed"
    row = _switch_row(out)
    assert row["recovery"] == "none" and row["recovery_s"] == 0 and row["predicted_recovery_s"] == 0
    assert row["checkpoint_s"] == 0
    assert run.checkpoint_steps() == [3]  # the final one only
