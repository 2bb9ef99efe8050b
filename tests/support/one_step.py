"""One real step of a job (flows/job/rl_step.run_step) on a fresh device pool, with the stage tasks
run as plain functions (their ``.fn``, as tests/flows/job/test_ppo_step_eos.py): what the step made
(its statistics, the rollout it wrote, its timed rows) and actor/train's weights after it, so that two
variants of one step can be compared number by number."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from flows.job import rl_step
from flows.job.data import JobData
from flows.job.records import JobRecords
from flows.job.step_context import StepContext
from nereus_core import job
from nereus_core.config import parse_config
from nereus_core.model.weights import init_full_state
from nereus_core.plan import ModelStage
from nereus_core.prompt_source import CountSource
from nereus_core.rl.rollout import NO_STOP, Stopping
from storage.run_dir import RunDir
from tasks import job_ops, model_ops, step_tasks
from tasks.runtime.device_pool import DevicePool

# Eight non-digit ids of 32 stop a response: a near-uniform random policy ends a row after about four
# tokens, so every row of a small batch stops well before a 16-token limit.
MANY_STOPS = Stopping(eos_ids=(11, 12, 13, 14, 15, 16, 17, 18), pad_id=0)


@dataclass
class OneStep:
    stats: dict[str, Any]
    lengths: list[int]
    rollout: dict[str, Any]
    rows: list[dict[str, Any]]
    actor: dict[str, torch.Tensor]  # actor/train's full state after the step


def run_one_step(
    config: dict[str, Any], root: Path, monkeypatch: pytest.MonkeyPatch, stopping: Stopping = NO_STOP
) -> OneStep:
    """Step 0 of ``config`` (a fresh run under ``root``); the reward model, where the job has one,
    from its seed (no fit)."""
    for name in ("generate", "experience", "train"):
        task = getattr(step_tasks, name)
        monkeypatch.setattr(step_tasks, name, getattr(task, "fn", task))  # a second step: done already
    cfg = parse_config(config)
    state = job.start(cfg)
    run = RunDir.create(root, cfg.model_dump(mode="json"))
    records = JobRecords(run)
    reward = (
        init_full_state(job.model_config(cfg, "reward/infer")) if cfg.algorithm.uses_reward_model else None
    )
    with DevicePool(cfg.cluster.devices) as pool:
        job_ops.load_models(pool, cfg, state.layouts, state.aliased, reward)
        source = CountSource(cfg.job.task_settings, cfg.job.batch_size, cfg.job.seed, stopping=stopping)
        stats, lengths, _ = rl_step.run_step(StepContext(pool, state, records, JobData(train=source)))
        train = ModelStage.ACTOR_TRAIN
        actor = model_ops.full_state(
            pool, state.layouts[train], name=str(train), config=job.model_config(cfg, str(train))
        )
    return OneStep(stats, lengths, run.read_rollout(0), records.rows, actor)
