"""A GRPO job's switches keep its state bit for bit, as PPO's do (tests/flows/test_transition.py,
test_faults.py): a forced live switch and a durable one (the device set grows) are verified against
the checkpoint taken before each, and a driver killed while the live switch moves state resumes and
completes. The job's model-stages are GRPO's: actor/generate, actor/train, reference/infer."""

from __future__ import annotations

import copy
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prefect.testing.utilities import prefect_test_harness

from flows.ppo_job import ppo_job
from nereus_core.config import parse_config
from storage import read_full_state
from storage.journal import journals
from storage.run_dir import RunDir

from .test_faults import (
    _assert_rollout_made_by_checkpoint,
    _kill_session,
    _plans_by_step,
    _resume,
    _start_run,
)

STAGES = {"actor/generate", "actor/train", "reference/infer"}
# 8 MiB per slot fits plan A at 6-token responses but not at 24 (the cost model's estimate: 3.9 and
# 8.1 MiB on the busiest slot), so the response-length event before step 1 forces a live switch.
BASE = {
    "name": "grpo-switch-test",
    "cluster": {"devices": 4, "memory_per_device": "8MiB"},
    "model": {
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "job": {
        "steps": 3,
        "batch_size": 16,
        "prompt_len": 4,
        "response_len": 6,
        "verify_transitions": True,
        "scenario": [{"step": 1, "response_len": 24}],
    },
    "algorithm": {"name": "grpo", "group_size": 4},
    "ppo": {"kl_coef": 0.0, "use_kl_loss": True, "kl_loss_coef": 0.01, "ppo_epochs": 1, "mini_batches": 2},
    "plan": {
        "actor/generate": {"pp": 2, "devices": [0, 1]},
        "actor/train": {"pp": 2, "devices": [0, 1]},
        "reference/infer": {"devices": [0]},
    },
}


def _config(**job: object) -> dict:
    data = copy.deepcopy(BASE)
    data["job"].update(job)
    return data


def _digests(run_dir: Path, step: int) -> dict[str, dict[str, bytes]]:
    return {
        model: {
            k: v.numpy().tobytes() for k, v in read_full_state(run_dir, model, step, optimizer=True).items()
        }
        for model in ("actor", "reference")
    }


def _run(tmp_path: Path, data: dict) -> Path:
    out = tmp_path / "run"
    with prefect_test_harness(server_startup_timeout=300):
        ppo_job(config=parse_config(data), out_dir=str(out))
    return out


def _assert_grpo_state(run_dir: Path) -> None:
    """Only GRPO's stages were ever planned, and only the actor and the reference hold state."""
    for journal in journals(run_dir):
        header = journal.header() or {}
        for plan in (header.get("old"), header.get("new")):
            assert plan is None or set(plan) == STAGES, plan
    assert {p.name for p in (run_dir / "state").iterdir()} == {"actor", "reference", "checkpoints"}


@pytest.mark.timeout(600)
def test_a_forced_live_switch_and_a_durable_one_keep_grpo_state_bitwise(tmp_path):
    # 2 slots, then 4 (a new world: the durable route), then 24-token responses (a live switch)
    data = _config(steps=4, scenario=[{"step": 1, "devices": 4}, {"step": 2, "response_len": 24}])
    data["cluster"]["devices"] = 2
    run_dir = _run(tmp_path, data)
    summary = RunDir(run_dir).read_summary()
    assert summary["status"] == "completed" and summary["steps"] == 4
    rows = pq.read_table(run_dir / "metrics" / "transitions.parquet").to_pylist()
    committed = [r for r in rows if r["status"] == "committed"]
    assert [r["route"] for r in committed] == ["durable", "live"]
    for r in committed:  # every model's live state == its checkpoint; the actor's log-probs within 1e-5
        assert r["verified_bitwise"] and r["verified_max_diff"] <= 1e-5, r
    _assert_grpo_state(run_dir)
    plans = _plans_by_step(run_dir)
    assert plans[2] != plans[1]  # the forced live switch before step 2
    _assert_rollout_made_by_checkpoint(run_dir, 2, tmp_path)  # the moved actor made rollout 2


@pytest.mark.slow  # two driver processes, each with its Prefect server and workers: 2 to 3 minutes
@pytest.mark.timeout(900)
def test_a_grpo_driver_killed_during_a_transfer_resumes_and_completes(tmp_path):
    crashed, out = _start_run(tmp_path, _config(), fault="kill-driver:move")
    try:
        crashed.wait(timeout=300)
    finally:
        _kill_session(crashed)
    assert crashed.returncode == -signal.SIGKILL, (tmp_path / "driver.log").read_text()[-2000:]
    (journal,) = [j for j in journals(out) if j.transition_id.startswith("t000")]
    assert journal.status() == "interrupted"
    before = _digests(out, 1)
    _resume(tmp_path, out)
    summary = RunDir(out).read_summary()
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 1
    assert summary["resume_verified_bitwise"]  # rehydrated on plan B == the checkpoint, bitwise
    assert _digests(out, 1) == before
    (resumed,) = [j for j in journals(out) if j.transition_id.startswith("resume-step1")]
    redone = {e["op"] for e in resumed.entries() if e["phase"] == "done"}
    assert {"rehydrate:actor/train#1", "rehydrate:reference/infer#1"} <= redone
    assert not any("critic" in op or "reward" in op for op in redone)
    _assert_grpo_state(out)
    plans = _plans_by_step(out)
    assert sorted(plans) == [0, 1, 2] and plans[1] != plans[0]
    _assert_rollout_made_by_checkpoint(out, 1, tmp_path)
