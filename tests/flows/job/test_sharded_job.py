"""PPO jobs whose train stages shard weights, gradients and optimizer state over dp (``shard: full``,
DeepSpeed ZeRO-3).

- Equivalence: actor/train and critic/train sharded over dp2 give the unsharded job's losses and
  scores each step within 1e-6 (of the loss's terms, of order 1) and, after 3 steps, its weights and
  optimizer state within 1e-6 relative (the same seeds, so the same rollouts).
- A driver killed while the first switch moves the sharded state resumes: ``nereus resume`` finishes
  the switch from the checkpoint, the state rehydrated from it verified bitwise; that checkpoint,
  written from the sharded layouts, exports to Hugging Face.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from storage import read_full_state
from storage.journal import journals
from tests.support.job_configs import FAULT_JOB, SMALL_MODEL
from tests.support.job_runs import (
    assert_rollout_made_by_checkpoint,
    killed_mid_move,
    plans_by_step,
    resume_from_checkpoint,
)

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

SMALL = {
    "name": "sharded-test",
    "cluster": {"devices": 4},
    "model": dict(SMALL_MODEL),
    "job": {"steps": 3, "batch_size": 8, "prompt_len": 4, "response_len": 4, "adapt": False},
    "ppo": {"reward_fit_steps": 3, "reward_fit_batch": 8, "ppo_epochs": 1, "mini_batches": 2},
    "plan": {
        "actor/generate": {"devices": [0]},
        "actor/train": {"dp": 2, "devices": [0, 1]},
        "critic/train": {"dp": 2, "devices": [2, 3]},
        "critic/infer": {"devices": [2]},
        "reference/infer": {"devices": [1]},
        "reward/infer": {"devices": [3]},
    },
}
TRAINED = ("actor/train", "critic/train")


def _job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard: str) -> Path:
    data = copy.deepcopy(SMALL)
    for stage in TRAINED:
        data["plan"][stage]["shard"] = shard
    out = tmp_path / shard
    monkeypatch.setenv("NEREUS_CACHE_DIR", str(tmp_path / "cache"))
    rl_job(config=parse_config(data), out_dir=str(out))
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.timeout(900)
def test_a_ppo_job_sharded_over_dp2_trains_as_the_unsharded_one(tmp_path, monkeypatch):
    runs = {shard: _job(tmp_path, monkeypatch, shard) for shard in ("optimizer", "full")}
    history = {
        shard: {r["step"]: r for r in pq.read_table(out / "metrics" / "history.parquet").to_pylist()}
        for shard, out in runs.items()
    }
    assert sorted(history["full"]) == sorted(history["optimizer"]) == [0, 1, 2]
    for step, whole in history["optimizer"].items():
        for stat in ("actor_loss", "critic_loss", "score"):
            got = history["full"][step][stat]
            # relative to the loss's terms, of order 1: PPO's clipped objective is a mean of terms that
            # nearly cancel (8e-4 here), so its own size would magnify a rounding difference
            assert abs(got - whole[stat]) <= 1e-6 * max(abs(whole[stat]), 1.0), (step, stat, got, whole[stat])
    for model in ("actor", "critic"):
        whole = read_full_state(runs["optimizer"], model, optimizer=True)
        sharded = read_full_state(runs["full"], model, optimizer=True)
        assert sharded.keys() == whole.keys()
        worst = max(_relative(sharded[k], whole[k]) for k in whole if whole[k].dtype.is_floating_point)
        assert worst <= 1e-6, (model, worst)


@pytest.mark.timeout(600)
def test_a_driver_killed_while_a_switch_moves_sharded_state_resumes(tmp_path):
    data = copy.deepcopy(FAULT_JOB)
    data["job"].update(verify_transitions=True)
    data["plan"]["actor/train"] = {"dp": 2, "devices": [0, 1], "shard": "full"}
    data["plan"]["critic/train"] = {"dp": 2, "devices": [0, 1], "shard": "full"}
    out, journal = killed_mid_move(tmp_path, data, timeout_s=240)
    done = [e for e in journal.entries() if e["phase"] == "done"]
    assert done and done[0]["bytes_moved"] > 0  # sharded state was moving when the driver died
    resume_from_checkpoint(tmp_path, out, 1)
    finished = [e for e in journal.entries() if e["op"] == "transition" and e["phase"] == "commit"]
    assert finished and finished[0]["finished_by"] == "resume"
    assert [j for j in journals(out) if j.transition_id.startswith("resume-step1")]
    plans = plans_by_step(out)
    assert sorted(plans) == [0, 1, 2] and plans[1] != plans[0]
    started = json.loads((out / "plans" / f"{plans[0]}.json").read_text())
    assert started["actor/train"]["shard"] == started["critic/train"]["shard"] == "full"
    # the checkpoint of step 1 was written from the sharded layouts: exported to Hugging Face, its
    # actor gives the log-probs the job stored for rollout 1
    assert_rollout_made_by_checkpoint(out, 1, tmp_path)
