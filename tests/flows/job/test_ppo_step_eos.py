"""One PPO step (flows/job/rl_step.run_step) with stop ids: variable-length responses end to end.

The stage tasks run as plain functions (their ``.fn``) on a real device pool: this is about the
step's data (responses, masks, losses), not its orchestration, which tests/flows/test_ppo_job.py
covers under Prefect's harness.
"""

from __future__ import annotations

import math

import pytest
import torch

from flows.job import rl_step
from flows.job.data import JobData
from flows.job.records import JobRecords
from flows.job.step_context import StepContext
from nereus_core import job
from nereus_core.config import parse_config
from nereus_core.model.weights import init_full_state
from nereus_core.prompt_source import CountSource
from nereus_core.rl.rollout import Stopping, response_mask
from storage.run_dir import RunDir
from tasks import job_ops, step_tasks
from tasks.runtime.device_pool import DevicePool
from tests.support.job_configs import SMALL_MODEL

T = 8
# Three non-digit ids of 32: a near-uniform random policy ends a row early about as often as not.
STOP = Stopping(eos_ids=(11, 12, 13), pad_id=0)
CONFIG = {
    "name": "ppo-eos",
    "cluster": {"devices": 2},
    "model": dict(SMALL_MODEL),
    "job": {"steps": 1, "batch_size": 8, "prompt_len": 4, "response_len": T},
    "ppo": {"ppo_epochs": 1, "mini_batches": 2},
    "plan": {
        "actor/generate": {"tp": 2, "devices": [0, 1]},
        "actor/train": {"pp": 2, "devices": [0, 1], "micro_batches": 2},
        "critic/train": {"dp": 2, "devices": [0, 1]},
        "critic/infer": {"dp": 2, "devices": [0, 1]},
        "reference/infer": {"devices": [1]},
        "reward/infer": {"devices": [0]},
    },
}


@pytest.mark.timeout(400)
def test_a_ppo_step_with_stop_ids_has_variable_lengths_masks_and_finite_losses(monkeypatch, tmp_path):
    for name in ("generate", "experience", "train"):
        monkeypatch.setattr(step_tasks, name, getattr(step_tasks, name).fn)
    cfg = parse_config(CONFIG)
    state = job.start(cfg)
    run = RunDir.create(tmp_path / "run", cfg.model_dump(mode="json"))
    reward_state = init_full_state(job.model_config(cfg, "reward/infer"))
    with DevicePool(2) as pool:
        job_ops.load_models(pool, cfg, state.layouts, state.aliased, reward_state)
        source = CountSource(cfg.job.task_settings, cfg.job.batch_size, cfg.job.seed, stopping=STOP)
        ctx = StepContext(pool, state, JobRecords(run), JobData(train=source))
        stats, lengths, _ = rl_step.run_step(ctx)
    rollout = run.read_rollout(0)
    responses, mask = torch.tensor(rollout["responses"]), torch.tensor(rollout["mask"])
    assert rollout["response_length"] == lengths == mask.sum(1).long().tolist()
    assert min(lengths) < T and len(set(lengths)) > 1, f"lengths {lengths}: the case is degenerate"
    assert torch.equal(mask, response_mask(responses, STOP.eos_ids))
    for row, n in zip(responses.tolist(), lengths, strict=True):
        if n < T:  # stopped: the stop token is the last real one, pads after it
            assert row[n - 1] in STOP.eos_ids and set(row[n:]) <= {STOP.pad_id}
        else:
            assert not set(row[: T - 1]) & set(STOP.eos_ids)
    assert stats["response_len_mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert stats["response_len_max"] == max(lengths)
    assert 0 < stats["response_clip_frac"] < 1 and stats["tokens"] == sum(lengths)
    for key in ("score", "kl", "actor_loss", "critic_loss", "actor_entropy", "actor_grad_norm"):
        assert math.isfinite(stats[key]), key
    # The estimators left the padding at zero.
    for key in ("advantages", "returns", "rewards"):
        assert not (torch.tensor(rollout[key]) * (1 - mask)).any(), key
