"""With one update per batch (ppo_epochs 1, mini_batches 1) and no KL penalty in the reward, the step
skips actor/train's old log-prob pass and the actor's loss takes the current log-probs, detached, as
the old ones (algorithms.Algorithm.reuses_old_logp, as TRL's GRPOTrainer with num_iterations 1). The
same step with the pass run (the rule patched off) is the evidence: the same losses, statistics,
gradient norm and updated weights, and the steps table records the skipped pass as ``reused``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nereus_core.rl import algorithms
from tests.support.job_configs import SMALL_MODEL
from tests.support.one_step import MANY_STOPS, OneStep, run_one_step

GRPO = {
    "name": "grpo-reuse",
    "cluster": {"devices": 1},
    "model": dict(SMALL_MODEL),
    "algorithm": {"name": "grpo", "group_size": 4},
    "job": {"steps": 1, "batch_size": 16, "prompt_len": 4, "response_len": 12},
    # A KL loss term: the reference runs and the step reports the KL to it.
    "ppo": {"kl_coef": 0.0, "use_kl_loss": True, "kl_loss_coef": 0.05, "ppo_epochs": 1, "mini_batches": 1},
    "plan": {"actor/train": {"devices": [0], "micro_batches": 2}},
}
PPO = {
    "name": "ppo-reuse",
    "cluster": {"devices": 1},
    "model": dict(SMALL_MODEL),
    "job": {"steps": 1, "batch_size": 8, "prompt_len": 4, "response_len": 12},
    "ppo": {"kl_coef": 0.0, "ppo_epochs": 1, "mini_batches": 1, "reward_fit_steps": 0},
    "plan": {"actor/train": {"devices": [0], "micro_batches": 2}},
}
SAME = ("score", "kl", "actor_loss", "actor_entropy", "actor_grad_norm", "tokens")


def both(config: dict[str, Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[OneStep, OneStep]:
    """The step with the pass reused, then with it run."""
    reused = run_one_step(config, tmp_path / "reused", monkeypatch, MANY_STOPS)
    with monkeypatch.context() as patched:
        patched.setattr(algorithms.Algorithm, "reuses_old_logp", lambda self, settings, *, engine_logp: False)
        ran = run_one_step(config, tmp_path / "ran", monkeypatch, MANY_STOPS)
    return reused, ran


def assert_same_step(reused: OneStep, ran: OneStep, keys: tuple[str, ...]) -> None:
    assert reused.lengths == ran.lengths and len(set(ran.lengths)) > 1  # one rollout, ragged
    for key in keys:
        assert reused.stats[key] == pytest.approx(ran.stats[key], rel=1e-6, abs=1e-9), key
    # The pass gives the policy's own log-probs: the ratio is 1 up to rounding, nothing clips.
    assert reused.stats["actor_clip_frac"] == ran.stats["actor_clip_frac"] == 0.0
    assert reused.stats["actor_approx_kl"] == 0.0 and abs(ran.stats["actor_approx_kl"]) < 1e-6
    assert reused.actor.keys() == ran.actor.keys()
    for name, weight in ran.actor.items():
        diff = (reused.actor[name] - weight).abs().max().item()
        assert diff <= 1e-6 * weight.abs().max().item(), f"{name}: {diff:.3g}"
    assert not torch.equal(ran.actor["model.norm.weight"], torch.ones_like(ran.actor["model.norm.weight"]))


def actor_infer_rows(step: OneStep) -> list[dict[str, Any]]:
    return [r for r in step.rows if (r["model"], r["stage"]) == ("actor", "infer")]


@pytest.mark.timeout(300)
def test_grpo_reuses_the_old_logp_pass_with_the_same_update(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reused, ran = both(GRPO, tmp_path, monkeypatch)
    assert_same_step(reused, ran, (*SAME, "actor_kl_loss"))
    (row,) = actor_infer_rows(reused)
    assert row["reused"] is True and row["duration_s"] == 0.0 and row["tokens"] > 0
    (timed,) = actor_infer_rows(ran)
    assert not timed.get("reused") and timed["duration_s"] > 0
    assert "old_logp" not in reused.rollout and "old_logp" in ran.rollout
    assert "actor_ref_kl" not in reused.stats  # the step's kl, not a statistic of its own


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ppo_reuses_it_too_and_its_critic_is_untouched(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reused, ran = both(PPO, tmp_path, monkeypatch)
    assert_same_step(reused, ran, (*SAME, "critic_loss", "critic_grad_norm"))
    assert actor_infer_rows(reused)[0]["reused"] is True


def test_the_pass_runs_where_it_would_differ() -> None:
    ppo = algorithms.PPOConfig(kl_coef=0.0, ppo_epochs=1, mini_batches=1)
    grpo = algorithms.GRPO
    assert grpo.reuses_old_logp(ppo, engine_logp=False) and algorithms.PPO.reuses_old_logp(
        ppo, engine_logp=False
    )
    assert not grpo.reuses_old_logp(ppo, engine_logp=True)  # vLLM's log-probs are compared with them
    for change in ({"ppo_epochs": 2}, {"mini_batches": 2}, {"kl_coef": 0.01}):  # updated / read before
        assert not grpo.reuses_old_logp(ppo.model_copy(update=change), engine_logp=False), change
    no_pass = algorithms.Algorithm("no-old", (algorithms.REF_LOGP,), grpo.estimator, grpo.objectives)
    assert not no_pass.reuses_old_logp(ppo, engine_logp=False)
