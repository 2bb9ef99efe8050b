"""tasks/step_tasks.train with GRPO's objective (algorithms.grpo_actor_objective): GRPO's loss over epochs of
whole-group mini-batches, statistics
averaged over optimizer steps as PPO's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nereus_core.layout import Layout
from nereus_core.rl import algorithms
from nereus_core.rl.algorithm import AlgorithmConfig
from nereus_core.rl.ppo import PPOConfig
from nereus_core.rl.rollout import Rollout, grouped, grpo_objective
from tasks import model_ops, spans, step_tasks


def test_train_actor_keeps_groups_whole_and_averages_statistics(monkeypatch: Any) -> None:
    calls: list[dict[str, Any]] = []

    def fake_train_stats(pool: Any, layout: Layout, batch: dict[str, torch.Tensor], **kw: Any) -> dict:
        calls.append({"prompts": batch["ids"][:, :2], **kw})
        i = float(len(calls))
        return {"loss": 10 * i, "clip_frac": i, "approx_kl": i, "entropy": i, "grad_norm": i}

    monkeypatch.setattr(model_ops, "train_stats", fake_train_stats)
    prompts = grouped(torch.arange(8).view(4, 2), 4)  # four prompts, four copies each
    rollout = Rollout(prompts=prompts, responses=torch.ones(16, 3, dtype=torch.long), mask=torch.ones(16, 3))
    algorithm = AlgorithmConfig(name="grpo", group_size=4)
    settings = PPOConfig(ppo_epochs=2, mini_batches=2)
    with spans.recording() as log:
        stats = step_tasks.train.fn(
            None,
            Layout.contiguous(),
            rollout,
            name="actor/train",
            objective=algorithms.grpo_actor_objective(settings, algorithm),
            settings=settings,
            seed=0,
        )
    assert len(calls) == 4 and all(c["with_entropy"] for c in calls)
    for c in calls:
        rows = [tuple(p.tolist()) for p in c["prompts"]]
        assert len(rows) == 8 and all(rows.count(p) == 4 for p in set(rows))  # two whole groups
        assert c["loss_fn"].func is grpo_objective and c["loss_fn"].keywords["algorithm"] is algorithm
    assert stats["loss"] == pytest.approx(25.0) and stats["grad_norm"] == pytest.approx(2.5)
    assert "kl_loss" not in stats and [s.name for s in log.spans] == ["actor/train"]  # no KL, no sync
