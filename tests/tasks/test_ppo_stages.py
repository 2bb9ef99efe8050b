"""tasks/step_tasks.train's statistics: each the mean over optimizer steps (mini-batches x epochs); its
times are spans (tasks/spans.py), not part of what it returns."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nereus_core.layout import Layout
from nereus_core.rl import algorithms
from nereus_core.rl.ppo import PPOConfig
from nereus_core.rl.rollout import Rollout
from tasks import model_ops, spans, step_tasks


@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
def test_train_averages_each_statistic_over_optimizer_steps(monkeypatch: Any, critic: bool) -> None:
    calls: list[dict[str, Any]] = []

    def fake_train_stats(pool: Any, layout: Layout, batch: dict[str, torch.Tensor], **kw: Any) -> dict:
        calls.append({"rows": batch["ids"].shape[0], **kw})
        i = float(len(calls))  # step i reports i for every statistic, 10 * i for the loss
        keys = algorithms.CRITIC_STATS if critic else algorithms.ACTOR_STATS
        return {**{key: i for key in keys}, "loss": 10 * i, "ratio_mean": -1.0}

    monkeypatch.setattr(model_ops, "train_stats", fake_train_stats)
    rollout = Rollout(
        prompts=torch.zeros(8, 2, dtype=torch.long),
        responses=torch.zeros(8, 3, dtype=torch.long),
        mask=torch.ones(8, 3),
    )
    settings = PPOConfig(ppo_epochs=2, mini_batches=2)
    with spans.recording() as log:
        stats = step_tasks.train.fn(
            None,
            Layout.contiguous(),
            rollout,
            name="m",
            objective=algorithms.ppo_objective(settings, critic=critic),
            settings=settings,
            seed=0,
        )
    assert [c["rows"] for c in calls] == [4, 4, 4, 4]
    assert all(c["with_entropy"] is not critic for c in calls)  # entropy for the policy only
    expected = algorithms.CRITIC_STATS if critic else algorithms.ACTOR_STATS
    assert list(stats) == list(expected)  # only the named statistics
    assert stats["loss"] == pytest.approx(25.0) and stats["grad_norm"] == pytest.approx(2.5)
    assert [s.name for s in log.spans] == ["m"] and log["m"].seconds >= 0  # trained, no sync asked
