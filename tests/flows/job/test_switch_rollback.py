"""A live switch that fails in live workers rolls back in memory, and the job goes on on plan A.

The job: GRPO on 2 slots, actor/train forced from dp=2 to tp=2 after step 0 (one wave of live moves:
the devices keep their old shards until the switch ends). With the ``fail-worker:move`` fault every
device raises once its new shard is installed. The switch is then undone in memory: a new world of
the same workers, plan A's shards rebuilt from the ones the devices kept, and the job runs its
remaining steps on plan A. Its final state equals, bit for bit, that of the same job never asked to
switch; no checkpoint was read to get there (the switch's recovery point is written in the
background from the kept shards, and never read; it equals the other run's checkpoint of the same
step). In fp32 and in bf16 with fp32 masters.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.job import switch as switch_module
from flows.job.rl_job import rl_job
from nereus_core import faults
from nereus_core.config import parse_config
from nereus_core.layout import Layout
from storage.journal import journals
from storage.run_dir import RunDir
from tests.support.forced_switches import forced_controller
from tests.support.job_runs import digests, plans_by_step

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

JOB = {
    "name": "rollback-test",
    "cluster": {"devices": 2, "memory_per_device": "1GiB"},
    "model": {
        "vocab_size": 32,  # digits are 10 of 32 tokens: rewards differ within a group from step 0
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    },
    "job": {
        "steps": 3,
        "batch_size": 8,
        "prompt_len": 4,
        "response_len": 6,
        "adapt": True,
        "switch_recovery": "async",
        "verify_transitions": False,
        "snapshot_every": 0,
    },
    "algorithm": {"name": "grpo", "group_size": 4},
    "ppo": {"kl_coef": 0.0, "use_kl_loss": False, "ppo_epochs": 1, "mini_batches": 1},
    "plan": {"actor/generate": {"devices": [0]}, "actor/train": {"dp": 2, "devices": [0, 1]}},
}


def _run(
    out: Path, monkeypatch: pytest.MonkeyPatch, *, switch: bool, fault: str | None, dtype: str, every: int = 0
) -> Path:
    targets = {0: {"actor/train": Layout(tp=2, devices=(0, 1))}} if switch else {}
    monkeypatch.setattr(switch_module, "controller_step", forced_controller(targets))
    faults.arm([fault] if fault else [])  # as the CLI does; the device pool arms it on its workers
    data = {**JOB, "model": {**JOB["model"], "dtype": dtype}, "job": {**JOB["job"], "snapshot_every": every}}
    try:
        rl_job(config=parse_config(data), out_dir=str(out))
    finally:
        faults.arm(())
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "dtype",
    ["fp32", pytest.param("bf16", marks=pytest.mark.slow)],  # bf16: weights and fp32 masters
)
def test_a_switch_that_fails_in_live_workers_rolls_back_in_memory(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("NEREUS_CACHE_DIR", str(tmp_path / "cache"))
    failed = _run(tmp_path / "failed", monkeypatch, switch=True, fault="fail-worker:move", dtype=dtype)
    run = RunDir(failed)
    assert run.read_summary()["status"] == "completed"
    (row,) = pq.read_table(failed / "metrics" / "transitions.parquet").to_pylist()
    assert row["status"] == "rolled_back" and row["route"] == "live" and row["rollback_s"] > 0
    assert "injected fault" in row["reason"] and "rolled back in memory" in row["reason"]
    assert row["staged_in_place"] == "actor/train"  # its recovery point: the kept shards, no copy
    plans = plans_by_step(failed)
    assert len(set(plans.values())) == 1  # every step on plan A
    (journal,) = [j for j in journals(failed) if j.transition_id.startswith("t000")]
    (end,) = [e for e in journal.entries() if e["op"] == "transition" and e["phase"] != "start"]
    assert end["phase"] == "abort" and end["rolled_back"]

    kept = _run(tmp_path / "kept", monkeypatch, switch=False, fault=None, dtype=dtype, every=1)
    assert plans_by_step(kept) == plans
    final = digests(failed, 3, ("actor",))
    assert final == digests(kept, 3, ("actor",))
    # The switch's recovery point, written from the shards the devices kept (and the rollback then
    # rebuilt plan A from), holds the state after step 0: the other run's checkpoint of step 1.
    assert digests(failed, 1, ("actor",)) == digests(kept, 1, ("actor",))
    # The steps after the rollback trained: the moments the rollback carried over are not zeros.
    moments = [b for k, b in final["actor"].items() if k.endswith(":exp_avg_sq")]
    assert moments and any(b.strip(b"\x00") for b in moments)
