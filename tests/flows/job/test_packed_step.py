"""``passes.pack: true`` (verl's use_remove_padding) runs every forward pass (reward, reference, critic
values, the actor's old log-probs) and every train step on the real tokens only; the padded step of the
same job is the evidence: the same scores, losses, statistics, rollout columns and updated weights
within 1e-5. Ragged responses (stop ids) and two micro-batches make the padding matter. GRPO (the
reference's and the old log-prob passes, the actor's train steps) runs by default; PPO (the reward
model's and critic's value passes, the critic's train steps too) and token-budget micro-batches are
marked slow."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.job_configs import SMALL_MODEL
from tests.support.one_step import MANY_STOPS, OneStep, run_one_step

PPO = {
    "name": "ppo-packed",
    "cluster": {"devices": 1},
    "model": dict(SMALL_MODEL),
    "job": {"steps": 1, "batch_size": 8, "prompt_len": 4, "response_len": 12},
    # Two mini-batches: the old log-prob pass runs (it is reused with one).
    "ppo": {"kl_coef": 0.01, "ppo_epochs": 1, "mini_batches": 2, "reward_fit_steps": 0},
    "plan": {
        "actor/train": {"devices": [0], "micro_batches": 2},
        "critic/train": {"devices": [0], "micro_batches": 2},
    },
}
GRPO = {
    "name": "grpo-packed",
    "cluster": {"devices": 1},
    "model": dict(SMALL_MODEL),
    "algorithm": {"name": "grpo", "group_size": 4},
    "job": {"steps": 1, "batch_size": 16, "prompt_len": 4, "response_len": 12},
    "ppo": {"kl_coef": 0.0, "use_kl_loss": True, "kl_loss_coef": 0.05, "ppo_epochs": 1, "mini_batches": 2},
}
# Where the critic's first update leaves its values within the clip of the old ones, its clipped and
# unclipped errors are one number but for rounding: which is larger is noise, and a count of it too.
ROUNDING_COUNTS = ("critic_value_clip_frac",)
COLUMNS = ("old_logp", "ref_logp", "values", "score", "rewards", "advantages", "returns")


def packed(config: dict[str, Any], **passes: Any) -> dict[str, Any]:
    return {**config, "passes": {"pack": True, **passes}}


def assert_same_step(ours: OneStep, padded: OneStep) -> None:
    assert ours.lengths == padded.lengths and len(set(padded.lengths)) > 1  # one rollout, ragged
    assert ours.stats.keys() == padded.stats.keys()
    for key, value in padded.stats.items():
        if key in ROUNDING_COUNTS:
            assert value <= 0.1 and ours.stats[key] <= 0.1, key
        elif isinstance(value, float) and not key.endswith("_s"):
            assert ours.stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    mask = torch.tensor(padded.rollout["mask"])
    for key in (k for k in COLUMNS if k in padded.rollout):
        theirs = torch.tensor(padded.rollout[key])
        real = mask if theirs.dim() == 2 else torch.ones_like(theirs)  # pads' log-probs are no one's
        assert torch.allclose(torch.tensor(ours.rollout[key]) * real, theirs * real, atol=1e-5), key
    # Adam's first steps move each weight by about lr * sign(g) (lr 1e-3): a weight whose gradient is
    # rounding-sized moves by a rounding-decided share of that, so the bound is 1 % of a step.
    for name, weight in padded.actor.items():
        assert torch.allclose(ours.actor[name], weight, rtol=1e-5, atol=1e-5), name


@pytest.mark.timeout(400)
def test_a_packed_grpo_step_is_the_padded_step(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    padded = run_one_step(GRPO, tmp_path / "padded", monkeypatch, MANY_STOPS)
    ours = run_one_step(packed(GRPO), tmp_path / "packed", monkeypatch, MANY_STOPS)
    assert_same_step(ours, padded)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_packed_ppo_step_is_the_padded_step(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    padded = run_one_step(PPO, tmp_path / "padded", monkeypatch, MANY_STOPS)
    ours = run_one_step(packed(PPO), tmp_path / "packed", monkeypatch, MANY_STOPS)
    assert_same_step(ours, padded)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_grpo_step_in_token_budget_micro_batches_is_the_padded_step(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    padded = run_one_step(GRPO, tmp_path / "padded", monkeypatch, MANY_STOPS)
    ours = run_one_step(packed(GRPO, max_tokens_per_device=40), tmp_path / "packed", monkeypatch, MANY_STOPS)
    assert_same_step(ours, padded)
