"""Adding an algorithm is one registry entry (nereus_core/rl/algorithms.py): a variant registered here,
REINFORCE with the batch's mean score as its baseline (Williams 1992), runs one real step through the
job's generic step (flows/job/rl_step.run_step) on a real device pool, with no flow file touched.

The stage tasks run as plain functions (their ``.fn``), as in test_ppo_step_eos.py: this is about what
the step does with the entry, not about Prefect's orchestration.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from flows.job import rl_step
from flows.job.data import JobData
from flows.job.records import JobRecords
from flows.job.step_context import StepContext
from nereus_core import job
from nereus_core.config import parse_config
from nereus_core.plan import ModelStage
from nereus_core.prompt_source import CountSource
from nereus_core.rl import algorithms
from nereus_core.rl.grpo import GroupSettings
from nereus_core.rl.ppo import PPOConfig
from nereus_core.rl.rollout import Rollout
from storage.run_dir import RunDir
from tasks import job_ops, step_tasks
from tasks.runtime.device_pool import DevicePool
from tests.support.job_configs import SMALL_MODEL

NAME = "reinforce_batch_mean"
CONFIG = {
    "name": "reinforce-entry",
    "cluster": {"devices": 1},
    "model": dict(SMALL_MODEL),
    "algorithm": {"name": NAME},
    "job": {"steps": 1, "batch_size": 8, "prompt_len": 4, "response_len": 6},
    "ppo": {"ppo_epochs": 1, "mini_batches": 2, "kl_coef": 0.0},  # no KL term: no reference
}


def batch_mean_advantages(r: Rollout, algorithm: GroupSettings, settings: PPOConfig) -> None:
    """REINFORCE's advantage with a batch-mean baseline: a response's score minus the batch's mean
    score, on each of its real tokens; the score is the reward, on the last real token."""
    last = r.mask.cumsum(1).eq(r.mask.sum(1, keepdim=True)) & r.mask.bool()
    r.rewards = last.to(r.mask.dtype) * r.score[:, None]
    r.advantages = (r.score - r.score.mean())[:, None] * r.mask


ENTRY = algorithms.Algorithm(
    name=NAME,
    passes=(algorithms.REF_LOGP, algorithms.OLD_LOGP),
    estimator=batch_mean_advantages,
    objectives={ModelStage.ACTOR_TRAIN: algorithms.ppo_actor},
)


@pytest.fixture
def registered() -> Iterator[algorithms.Algorithm]:
    entry = algorithms.register(ENTRY)
    try:
        yield entry
    finally:
        del algorithms.ALGORITHMS[NAME]


def test_a_registered_entry_decides_the_jobs_model_stages(registered: algorithms.Algorithm) -> None:
    cfg = parse_config(CONFIG)
    assert cfg.algorithm.entry is registered and not cfg.algorithm.uses_critic
    assert cfg.stages == ("actor/generate", "actor/train")  # a reference only with a KL term
    with_kl = parse_config({**CONFIG, "ppo": {**CONFIG["ppo"], "kl_coef": 0.05}})
    assert ModelStage.REFERENCE_INFER in with_kl.stages


@pytest.mark.timeout(300)
def test_one_step_of_a_registered_variant_trains_on_its_own_advantages(
    registered: algorithms.Algorithm, monkeypatch: Any, tmp_path: Any
) -> None:
    trained_on: list[torch.Tensor] = []
    train_fn = step_tasks.train.fn

    def train(**kwargs: Any) -> dict[str, float]:
        trained_on.append(kwargs["rollout"].advantages.clone())  # what the train stage is handed
        return train_fn(**kwargs)

    for name in ("generate", "experience"):
        monkeypatch.setattr(step_tasks, name, getattr(step_tasks, name).fn)
    monkeypatch.setattr(step_tasks, "train", train)
    cfg = parse_config(CONFIG)
    state = job.start(cfg)
    run = RunDir.create(tmp_path / "run", cfg.model_dump(mode="json"))
    records = JobRecords(run)
    with DevicePool(1) as pool:
        job_ops.load_models(pool, cfg, state.layouts, state.aliased, None)
        source = CountSource(cfg.job.task_settings, cfg.job.batch_size, cfg.job.seed)
        stats, lengths, _ = rl_step.run_step(StepContext(pool, state, records, JobData(train=source)))
    rollout = run.read_rollout(0)
    score, mask = torch.tensor(rollout["score"]), torch.tensor(rollout["mask"])
    assert score.std() > 0, f"scores {score.tolist()}: every advantage would be zero"
    expected = (score - score.mean())[:, None] * mask  # the variant's estimator, not GAE's nor GRPO's
    assert torch.allclose(torch.tensor(rollout["advantages"]), expected, atol=1e-6)
    assert len(trained_on) == 1 and torch.allclose(trained_on[0], expected, atol=1e-6)
    assert "returns" not in rollout and "values" not in rollout  # no critic ran
    assert math.isfinite(stats["actor_loss"]) and "critic_loss" not in stats and len(lengths) == 8
    timed = {(r["model"], r["stage"]) for r in records.rows}
    assert (NAME, "advantages") in timed and ("actor", "train") in timed
    assert ("reference", "infer") not in timed
