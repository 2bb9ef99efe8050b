"""GRPO math (nereus_core/rl/grpo.py) and the algorithm section (nereus_core/rl/algorithm.py) on hand-built
cases; tests/core/rl/test_grpo_trl.py checks the same maths against TRL's GRPOTrainer."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from nereus_core.rl.algorithm import AlgorithmConfig
from nereus_core.rl.grpo import LOSS_AGGREGATIONS, group_advantages, grpo_loss
from tests.support.tensors import close

# ---- hand-built cases -------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("baseline", ["group_mean", "leave_one_out"])
def test_equal_rewards_in_a_group_give_zero_advantage(scale: str, baseline: str) -> None:
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.7, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    adv = group_advantages(rewards, 4, scale_rewards=scale, baseline=baseline)
    close(adv[:4], [0.0] * 4)
    assert adv[4:].abs().min() > 0.4


def test_std_normalisation_on_and_off() -> None:
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    std = (1.0 / 3.0) ** 0.5  # unbiased std of 0, 1, 0, 1
    half = 0.5 / (std + 1e-4)
    close(group_advantages(rewards, 4, scale_rewards="group"), [-half, half, -half, half])
    close(group_advantages(rewards, 4, scale_rewards="none"), [-0.5, 0.5, -0.5, 0.5])


def test_batch_scaling_uses_the_std_of_all_rewards() -> None:
    rewards = torch.tensor([0.0, 2.0, 1.0, 1.0], dtype=torch.float64)  # groups of 2
    std = float(rewards.std())  # unbiased over all four: sqrt(2/3)
    close(group_advantages(rewards, 2, scale_rewards="batch"), [-1 / (std + 1e-4), 1 / (std + 1e-4), 0, 0])


def test_leave_one_out_baseline() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards, 4, scale_rewards="none", baseline="leave_one_out")
    close(adv, [1.0, -1 / 3, -1 / 3, -1 / 3])


def test_bad_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(6), 1)
    with pytest.raises(ValueError, match="valid: group, batch, none"):
        group_advantages(torch.zeros(4), 2, scale_rewards="std")  # type: ignore[arg-type]


def test_aggregation_weights() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    close(LOSS_AGGREGATIONS["token-mean"](mask), [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]])
    close(LOSS_AGGREGATIONS["token-mean"](mask, num_tokens=6), [[1 / 6, 1 / 6, 0], [1 / 6, 0, 0]])
    close(LOSS_AGGREGATIONS["seq-mean-token-mean"](mask), [[1 / 4, 1 / 4, 0], [1 / 2, 0, 0]])
    close(LOSS_AGGREGATIONS["seq-mean-token-sum"](mask), [[1 / 2, 1 / 2, 0], [1 / 2, 0, 0]])
    close(LOSS_AGGREGATIONS["seq-mean-token-sum-norm"](mask, max_len=4), [[1 / 8, 1 / 8, 0], [1 / 8, 0, 0]])
    with pytest.raises(ValueError, match="shorter than the responses"):
        LOSS_AGGREGATIONS["seq-mean-token-sum-norm"](mask, max_len=2)


def test_clip_higher_lets_good_tokens_rise_further() -> None:
    # One token per response: ratio 1.25 with A = +1, ratio 0.75 with A = -1.
    logp = torch.log(torch.tensor([[1.25], [0.75]], dtype=torch.float64))
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    sym, _ = grpo_loss(logp, old, adv, mask, loss_agg_mode="seq-mean-token-sum", epsilon=0.2)
    close(sym, (-1.2 + 0.8) / 2)  # both clipped at 1 +- 0.2
    high, stats = grpo_loss(
        logp, old, adv, mask, loss_agg_mode="seq-mean-token-sum", epsilon=0.2, epsilon_high=0.28
    )
    close(high, (-1.25 + 0.8) / 2)  # the good token is inside 1.28; the bad one still clipped at 0.8
    close(stats["clip_frac"], 0.5)


def test_kl_term_needs_the_reference() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="needs ref_logp_bt"):
        grpo_loss(x, x, torch.zeros(2), torch.ones(2, 3), kl_coef=0.1)
    with pytest.raises(ValueError, match="valid: token-mean, seq-mean-token-mean"):
        grpo_loss(x, x, torch.zeros(2), torch.ones(2, 3), loss_agg_mode="token-sum")


# ---- the algorithm section --------------------------------------------------------------------


def test_algorithm_defaults_are_ppo_and_grpo_needs_a_group() -> None:
    assert AlgorithmConfig().name == "ppo" and AlgorithmConfig().uses_critic
    cfg = AlgorithmConfig(name="grpo", group_size=8, loss_agg_mode="seq-mean-token-sum-norm")
    assert not cfg.uses_critic
    with pytest.raises(ValidationError, match="group_size must be at least 2"):
        AlgorithmConfig(name="grpo")
    with pytest.raises(ValidationError, match="group_size=4 is read by grpo only"):
        AlgorithmConfig(group_size=4)


@pytest.mark.parametrize(
    ("field", "valid"),
    [
        ("name", "ppo, grpo"),
        ("scale_rewards", "group, batch, none"),
        ("baseline", "group_mean, leave_one_out"),
        ("loss_agg_mode", "token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"),
    ],
)
def test_unknown_names_are_refused_with_the_valid_ones(field: str, valid: str) -> None:
    with pytest.raises(ValidationError) as err:
        AlgorithmConfig(**{field: "bogus"})
    assert f"'bogus' is unknown; valid: {valid}" in str(err.value)


def test_algorithm_bounds() -> None:
    # kl_loss_coef is the ppo section's (one owner): here it is an unknown field.
    for bad in ({"group_size": 0}, {"kl_loss_coef": 0.1}, {"clip_ratio_high": 0.0}, {"extra": 1}):
        with pytest.raises(ValidationError):
            AlgorithmConfig(**bad)
