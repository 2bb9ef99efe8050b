"""PPO math (nereus_core/rl/ppo.py), the rollout's objectives and length statistics
(nereus_core/rl/rollout.py),
on small tensors computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from nereus_core.rl.ppo import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    VALUE_LOSSES,
    PPOConfig,
    gae,
    kl_loss,
    kl_penalty,
    last_token_index,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    shaped_rewards,
    value_loss,
)
from nereus_core.rl.rollout import actor_objective, critic_objective, length_stats


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def close(a: torch.Tensor, b: list[list[float]] | list[float]) -> None:
    torch.testing.assert_close(a, torch.tensor(b, dtype=a.dtype), rtol=0, atol=1e-6)


# ---- masked statistics ---------------------------------------------------------------------------


def test_masked_mean_all_and_per_row() -> None:
    x = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert float(masked_mean(x, mask)) == pytest.approx((1 + 2 + 4) / 3)
    close(masked_mean(x, mask, dim=1), [1.5, 4.0, 0.0])  # an empty row gives 0, not nan


def test_masked_var_is_unbiased_by_default() -> None:
    # masked entries 2, 4, 6: mean 4, squared deviations 4 + 0 + 4 = 8.
    x, mask = t([[2, 4, 6, 100]]), t([[1, 1, 1, 0]])
    assert float(masked_var(x, mask)) == pytest.approx(8 / 2)
    assert float(masked_var(x, mask, unbiased=False)) == pytest.approx(8 / 3)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, t([[1, 0, 0, 0]]))


def test_masked_whiten_ignores_padding() -> None:
    # Mean 4, unbiased std 2: (2, 4, 6) -> (-1, 0, 1); the padded 100 plays no part and comes out 0.
    x, mask = t([[2, 4, 100], [6, 100, 100]]), t([[1, 1, 0], [1, 0, 0]])
    close(masked_whiten(x, mask), [[-1, 0, 0], [1, 0, 0]])
    close(masked_whiten(x, mask, shift_mean=False), [[3, 4, 0], [5, 0, 0]])


# ---- KL ------------------------------------------------------------------------------------------


def test_kl_estimators_by_hand() -> None:
    # log(pi/ref) = +1 on the first token, -1 on the second, 0 on the third.
    logp, ref = t([[-1.0, -2.0, -3.0]]), t([[-2.0, -1.0, -3.0]])
    close(kl_penalty(logp, ref, "k1"), [[1.0, -1.0, 0.0]])
    close(kl_penalty(logp, ref, "abs"), [[1.0, 1.0, 0.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.5, 0.5, 0.0]])
    # k3 = exp(ref - logp) - (ref - logp) - 1: e^-1 + 1 - 1 and e^1 - 1 - 1.
    close(kl_penalty(logp, ref, "k3"), [[math.exp(-1), math.e - 2, 0.0]])
    with pytest.raises(ValueError, match="k1, k2, k3, abs"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_k3_is_never_negative_and_finite() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(64, 16, generator=gen) * 30
    k3 = kl_penalty(logp, torch.zeros_like(logp), "k3")
    assert bool((k3 >= 0).all()) and bool(torch.isfinite(k3).all())


def test_kl_loss_is_masked_mean_of_k3() -> None:
    logp, ref, mask = t([[-1.0, -2.0, 5.0]]), t([[-2.0, -1.0, 0.0]]), t([[1, 1, 0]])
    assert float(kl_loss(logp, ref, mask)) == pytest.approx((math.exp(-1) + math.e - 2) / 2)
    assert float(kl_loss(logp, ref, mask, "k1")) == pytest.approx(0.0)


# ---- rewards and advantages ----------------------------------------------------------------------


def test_last_token_index_with_ragged_masks() -> None:
    mask = t([[1, 1, 1], [1, 1, 0], [0, 1, 0], [0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 1, 1, -1]


def test_shaped_rewards_put_the_score_at_the_last_real_token() -> None:
    # KL (k1) per token is logp - ref = logp here; kl_coef 0.5 gives -0.5 * logp.
    logp = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.2, 0.4, 0.6], [1, 1, 1]])
    mask = t([[1, 1, 1], [1, 1, 0], [0, 1, 0], [0, 0, 0]])
    score = torch.tensor([1.0, 0.5, 2.0, 3.0], dtype=torch.float64)
    rewards = shaped_rewards(score, logp, torch.zeros_like(logp), mask, kl_coef=0.5)
    close(
        rewards,
        [
            [-0.05, -0.10, -0.15 + 1.0],
            [-0.20, -0.25 + 0.5, 0.0],
            [0.0, -0.20 + 2.0, 0.0],
            [0.0, 0.0, 0.0],  # no real token: no KL and no score
        ],
    )
    no_kl = shaped_rewards(score, logp, torch.zeros_like(logp), mask, kl_coef=0.0)
    close(no_kl.sum(dim=1), [1.0, 0.5, 2.0, 0.0])


def test_shaped_rewards_use_the_chosen_estimator() -> None:
    logp, ref, mask = t([[-1.0, -2.0]]), t([[-2.0, -1.0]]), t([[1, 1]])
    rewards = shaped_rewards(torch.zeros(1), logp, ref, mask, kl_coef=1.0, kind="abs")
    close(rewards, [[-1.0, -1.0]])


def test_gae_one_row_by_hand() -> None:
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72); the value after the last token is 0.
    #   t=2: delta = 1 + 0.9*0   - 0.7 = 0.3;   A2 = 0.3
    #   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03;  A1 = 0.03 + 0.72*0.3   = 0.246
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;  A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = (0.71712, 0.846, 1.0)
    adv, ret = gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_ragged_and_holes() -> None:
    # gamma = lam = 1. Row 0 ends at t=1: A1 = 1 - 0.2 = 0.8, A0 = (0.2 - 0.5) + 0.8 = 0.5.
    # Row 1 has a hole at t=1, passed over: A2 = 1 - 0.3 = 0.7, A0 = (0.3 - 0.5) + 0.7 = 0.5.
    rewards = t([[0, 1, 999], [0, 999, 1]])
    values = t([[0.5, 0.2, 999], [0.5, 999, 0.3]])
    mask = t([[1, 1, 0], [1, 0, 1]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.8, 0.0], [0.5, 0.0, 0.7]])
    close(ret, [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])


def test_gae_lam_zero_is_one_step_td_and_carries_no_gradient() -> None:
    values = t([[0.5, 0.6, 0.7]]).requires_grad_()
    adv, ret = gae(t([[0.1, 0.2, 1.0]]), values, t([[1, 1, 1]]), gamma=0.5, lam=0.0)
    # delta_t = r_t + 0.5 V_{t+1} - V_t
    close(adv, [[0.1 + 0.3 - 0.5, 0.2 + 0.35 - 0.6, 1.0 - 0.7]])
    assert not adv.requires_grad and not ret.requires_grad


@st.composite
def _rollouts(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, t_len = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    floats = st.floats(-5, 5, allow_nan=False, width=32)
    rewards = torch.tensor(draw(st.lists(floats, min_size=b * t_len, max_size=b * t_len))).view(b, t_len)
    values = torch.tensor(draw(st.lists(floats, min_size=b * t_len, max_size=b * t_len))).view(b, t_len)
    lengths = torch.tensor(draw(st.lists(st.integers(0, t_len), min_size=b, max_size=b)))
    mask = (torch.arange(t_len) < lengths[:, None]).float()  # right-padded
    return rewards.double(), values.double(), mask.double()


@settings(max_examples=60, deadline=None)
@given(_rollouts())
def test_gae_with_lam_and_gamma_one_returns_reward_to_go(
    rollout: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    rewards, values, mask = rollout
    to_go = (rewards * mask).flip(1).cumsum(1).flip(1) * mask
    # Values telescope away: returns are the reward-to-go whatever the critic says ...
    _, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, to_go)
    # ... and with a zero critic the advantages are the reward-to-go too.
    adv, _ = gae(rewards, torch.zeros_like(values), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, to_go)


# ---- losses --------------------------------------------------------------------------------------

# Ratios and advantages of six real tokens and one padded one, with clip_ratio 0.2:
#   r=1.0 A=+1: max(-1.0, -1.0) = -1.0
#   r=1.5 A=+1: max(-1.5, -1.2) = -1.2  clipped (ratio above 1.2 with a good action)
#   r=0.5 A=-1: max( 0.5,  0.8) =  0.8  clipped (ratio below 0.8 with a bad action)
#   r=1.1 A=-1: max( 1.1,  1.1) =  1.1
#   r=1.5 A=-1: max( 1.5,  1.2) =  1.5  not clipped: the pessimistic side keeps the gradient
#   r=0.5 A=+1: max(-0.5, -0.8) = -0.5  not clipped
# loss = (-1 - 1.2 + 0.8 + 1.1 + 1.5 - 0.5) / 6 = 0.7 / 6
RATIOS = [1.0, 1.5, 0.5, 1.1, 1.5, 0.5, 3.0]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 50.0]
MASK = [1, 1, 1, 1, 1, 1, 0]


def test_policy_loss_inside_and_outside_the_clip_range() -> None:
    old = t([[-1.0] * 7])
    logp = (old + torch.log(t([RATIOS]))).requires_grad_()
    loss, stats = policy_loss(logp, old, t([ADVANTAGES]), t([MASK]), clip_ratio=0.2)
    assert float(loss.detach()) == pytest.approx(0.7 / 6)
    # Two of the six real tokens take the clipped branch; the padded one (r=3, A=50) would too.
    assert float(stats["clip_frac"]) == pytest.approx(2 / 6)
    assert float(stats["ratio_mean"]) == pytest.approx(6.1 / 6)
    # verl's ppo_kl: the token-mean of old_logp - logp = -log r, padding left out.
    assert float(stats["approx_kl"]) == pytest.approx(-sum(math.log(r) for r in RATIOS[:6]) / 6)
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())
    # d/dlogp of -A r is -A r; zero where the clipped term wins and on padding.
    loss.backward()
    assert logp.grad is not None
    close(logp.grad, [[-1.0 / 6, 0.0, 0.0, 1.1 / 6, 1.5 / 6, -0.5 / 6, 0.0]])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-2, 2, allow_nan=False), st.floats(-3, 3, allow_nan=False)),
        min_size=1,
        max_size=12,
    ),
    st.floats(0.05, 0.5),
)
def test_policy_loss_gradient_vanishes_where_clipped(pairs: list[tuple[float, float]], clip: float) -> None:
    log_ratio = torch.tensor([[lr for lr, _ in pairs]], dtype=torch.float64)
    adv = torch.tensor([[a for _, a in pairs]], dtype=torch.float64)
    old = torch.zeros_like(log_ratio)
    logp = log_ratio.clone().requires_grad_()
    loss, _ = policy_loss(logp, old, adv, torch.ones_like(adv), clip_ratio=clip)
    loss.backward()
    assert logp.grad is not None
    ratio = log_ratio.exp()
    clipped = ((adv > 0) & (ratio > 1 + clip)) | ((adv < 0) & (ratio < 1 - clip))
    assert bool((logp.grad[clipped] == 0).all())
    expected = -adv * ratio / len(pairs)
    torch.testing.assert_close(logp.grad[~clipped], expected[~clipped])


def test_value_loss_clipping_by_hand() -> None:
    # Old values 0, clip 0.2, so V_clip = clamp(V, -0.2, 0.2):
    #   V= 0.5 R= 1.0: (V-R)^2 = 0.25, (V_clip-R)^2 = 0.64 -> 0.64 (clipped wins)
    #   V= 0.1 R= 1.0: 0.81, 0.81                          -> 0.81
    #   V=-0.5 R=-0.1: 0.16, 0.01                          -> 0.16
    # loss = 0.5 * (0.64 + 0.81 + 0.16) / 3. The padded token (V=9, R=5: 16 vs 23.04) would be
    # clipped too: masking decides the clip fraction.
    values = t([[0.5, 0.1, -0.5, 9.0]]).requires_grad_()
    returns, mask = t([[1.0, 1.0, -0.1, 5.0]]), t([[1, 1, 1, 0]])
    loss, stats = value_loss(values, torch.zeros_like(returns), returns, mask, clip_range=0.2)
    assert float(loss.detach()) == pytest.approx(0.5 * 1.61 / 3)
    assert float(stats["value_clip_frac"]) == pytest.approx(1 / 3)
    assert float(stats["mse"]) == pytest.approx((0.25 + 0.81 + 0.16) / 3)
    assert float(stats["value_mean"]) == pytest.approx(0.1 / 3)
    # The clipped token gets no gradient; the others get (V - R) / 3.
    loss.backward()
    assert values.grad is not None
    close(values.grad, [[0.0, -0.9 / 3, -0.4 / 3, 0.0]])


# ---- the rollout's objectives and lengths --------------------------------------------------------


def test_actor_objective_statistics_on_the_response_columns() -> None:
    # Prompt of 2 tokens: the lm head's 8 columns are 1 prompt column (junk) + the 7 response ones.
    old = t([[-1.0] * 7])
    logp_full = torch.cat([t([[123.0]]), old + torch.log(t([RATIOS]))], dim=1)
    entropy_full = t([[1000.0, 1, 2, 3, 4, 5, 6, 1000]])
    batch = {"mask": t([MASK]), "old_logp": old, "advantages": t([ADVANTAGES]), "entropy": entropy_full}
    loss, stats = actor_objective(logp_full, batch, settings=PPOConfig())
    assert float(loss) == pytest.approx(0.7 / 6)
    assert set(stats) == {"clip_frac", "approx_kl", "entropy"}
    assert float(stats["clip_frac"]) == pytest.approx(2 / 6)
    assert float(stats["entropy"]) == pytest.approx(21 / 6)  # the padded 1000 and the prompt's left out
    del batch["entropy"]
    assert "entropy" not in actor_objective(logp_full, batch, settings=PPOConfig())[1]


def test_critic_objective_reports_the_value_clip_fraction() -> None:
    # Prompt of 2, response of 4: the response's values are columns 1..4 of the head's 6.
    values_full = t([[50.0, 0.5, 0.1, -0.5, 9.0, 50.0]])
    batch = {"mask": t([[1, 1, 1, 0]]), "values": t([[0.0] * 4]), "returns": t([[1.0, 1.0, -0.1, 5.0]])}
    loss, stats = critic_objective(values_full, batch, settings=PPOConfig(value_clip=0.2))
    assert float(loss) == pytest.approx(0.5 * 1.61 / 3)
    assert set(stats) == {"value_clip_frac"} and float(stats["value_clip_frac"]) == pytest.approx(1 / 3)


def test_length_stats_of_ragged_responses() -> None:
    # Lengths 5, 3, 0 and 5 (the last one with a hole: 4 tokens) under a limit of 5.
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 1, 1]])
    stats = length_stats(mask, limit=5)
    assert stats == {"response_len_mean": 3.0, "response_len_max": 5.0, "response_clip_frac": 0.25}
    # Fixed-length responses (the demo's task): every one at the limit.
    assert length_stats(torch.ones(3, 6), limit=6)["response_clip_frac"] == 1.0
    assert length_stats(torch.ones(3, 6), limit=8)["response_clip_frac"] == 0.0
    with pytest.raises(ValueError, match="above limit=4"):
        length_stats(mask, limit=4)
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        length_stats(torch.ones(5), limit=5)


# ---- registry and settings -----------------------------------------------------------------------


def test_registries_name_the_functions() -> None:
    assert ADVANTAGE_ESTIMATORS["gae"] is gae
    assert POLICY_LOSSES["ppo_clip"] is policy_loss
    assert VALUE_LOSSES["clipped_mse"] is value_loss


def test_ppo_settings_defaults() -> None:
    s = PPOConfig()
    assert (s.gamma, s.lam, s.clip_ratio, s.value_clip, s.kl_coef, s.kl_kind) == (
        1.0,
        0.95,
        0.2,
        0.2,
        0.05,
        "k1",
    )
    assert (s.use_kl_loss, s.kl_loss_coef, s.ppo_epochs, s.mini_batches) == (False, 0.0, 2, 2)
    assert (s.whiten_advantages, s.temperature, s.actor_lr, s.critic_lr) == (True, 1.0, 1e-3, 1e-3)
    assert (s.reward_fit_steps, s.reward_fit_lr, s.reward_fit_batch) == (300, 1e-3, 64)
    assert ADVANTAGE_ESTIMATORS[s.advantage_estimator] is gae
    for name, field in PPOConfig.model_fields.items():
        assert field.description, f"{name} has no description"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"advantage_estimator": "grpo"}, "valid: gae"),
        ({"policy_loss": "dpo"}, "valid: ppo_clip"),
        ({"clip_ratio": 1.5}, "less than 1"),
        ({"lam": -0.1}, "greater than or equal to 0"),
        ({"kl_kind": "k4"}, "k1"),
        ({"use_kl_loss": True}, "kl_loss_coef > 0"),
        ({"gamam": 0.9}, "Extra inputs"),
    ],
)
def test_ppo_settings_reject_bad_values(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PPOConfig.model_validate(data)


def test_ppo_settings_are_frozen() -> None:
    s = PPOConfig(use_kl_loss=True, kl_loss_coef=0.001)
    with pytest.raises(ValidationError):
        s.gamma = 0.5  # type: ignore[misc]
