"""GRPO math: group-relative advantages and the critic-free clipped policy loss.

Boundary: tensors in, tensors out, as ``ppo.py``. No models, optimizers, samplers or config; the
engines compute log-probs, the job groups the ``group_size`` responses of a prompt next to each
other (rows ``g * group_size ... (g + 1) * group_size - 1`` answer prompt ``g``) and calls these
functions. ``ppo.py`` owns the clipped surrogate, the KL estimators and ``masked_mean``; this module
only decides how advantages are formed and how tokens are weighed.

What is followed, and from where:

- Group-relative advantages (GRPO, Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, sec. 4.1.2):
  ``A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)``, the same for every token of response i,
  with the unbiased (n - 1) standard deviation and the 1e-4 that TRL's ``GRPOTrainer`` uses.
  ``scale_rewards`` as TRL names it: ``group`` (the std of the group), ``batch`` (the std of the
  whole batch; PPO-Lite, arXiv:2508.08221) or ``none`` (no division; Dr. GRPO, Liu et al. 2025,
  arXiv:2503.20783, which finds the division biases towards too easy and too hard prompts).
- Leave-one-out baseline (RLOO, Ahmadian et al. 2024, arXiv:2402.14740):
  ``A_i = r_i - mean_{j != i}(r_j) = G / (G - 1) * (r_i - mean(r_group))``, the same code with
  another baseline; with ``scale_rewards="none"`` it equals TRL's ``RLOOTrainer`` advantages.
- Policy loss: PPO's clipped surrogate (``ppo.policy_loss``) on each token, with DAPO's
  clip-higher (Yu et al. 2025, arXiv:2503.14476): the ratio may rise to ``1 + epsilon_high`` but
  fall only to ``1 - epsilon``. For a positive advantage only the upper bound can bind, for a
  negative one only the lower, so the asymmetric surrogate is the symmetric one with
  ``epsilon_high`` on positive-advantage tokens and ``epsilon`` on the others.
- KL to the reference as a loss term (GRPO eq. 4) with a per-token estimator from ``ppo.kl_penalty``
  (k3 in the paper), optionally weighted by the importance ratio ``pi / pi_old`` so that its
  gradient is the unbiased reverse-KL gradient off-policy (DeepSeek-V3.2, arXiv:2512.02556;
  TRL's ``use_bias_correction_kl``).
- Aggregation over tokens (``loss_agg_mode``, verl's names), each a weight per token so the loss
  is ``sum_bt(loss_bt * w_bt)``; TRL's ``loss_type`` in brackets:
  ``token-mean`` (DAPO; TRL ``bnpo``, and ``dapo`` when ``num_tokens`` is the whole generation
  batch's count) ``w = m / sum(m)``; ``seq-mean-token-mean`` (the original GRPO; TRL ``grpo``)
  ``w = m / (B * |o_i|)``; ``seq-mean-token-sum-norm`` (Dr. GRPO; TRL ``dr_grpo``)
  ``w = m / (B * max_len)`` with a constant ``max_len``; ``seq-mean-token-sum`` (verl) ``w = m / B``.
  ``ppo.policy_loss`` takes ``mask_bt`` as a weight (its ``masked_mean`` is a weighted mean), so
  it is called with ``w`` and its result rescaled by ``sum(w)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol, get_args

import torch

from nereus_core.rl.ppo import KLKind, LossAndStats, kl_penalty, masked_mean, policy_loss

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = get_args(ScaleRewards)
Baseline = Literal["group_mean", "leave_one_out"]
BASELINES: tuple[str, ...] = get_args(Baseline)


class GroupSettings(Protocol):
    """What GRPO's estimator and loss read of the ``algorithm:`` section (``AlgorithmConfig``, which
    this module does not import: the config validates against the names here)."""

    @property
    def group_size(self) -> int: ...
    @property
    def baseline(self) -> str: ...
    @property
    def scale_rewards(self) -> str: ...
    @property
    def loss_agg_mode(self) -> str: ...
    @property
    def clip_ratio_high(self) -> float | None: ...
    @property
    def loss_scale_tokens(self) -> int | None: ...
    @property
    def kl_ratio_weighted(self) -> bool: ...


# TRL divides by std + 1e-4 (GRPOTrainer._generate_and_score_completions), not std + 1e-8.
_STD_EPS = 1e-4


def group_advantages(
    rewards_b: torch.Tensor,
    group_size: int,
    *,
    scale_rewards: ScaleRewards = "group",
    baseline: Baseline = "group_mean",
) -> torch.Tensor:
    """Per-response advantages ``[b]`` from per-response rewards ``[b]``, ``b = prompts * group_size``.

    ``baseline``: ``group_mean`` (GRPO) or ``leave_one_out`` (RLOO). ``scale_rewards``: divide by the
    group's reward std (``group``), the batch's (``batch``), or not at all (``none``); the std is
    unbiased, plus 1e-4. A group whose rewards are all equal gets 0. No gradient flows: a target.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 to compare responses, got {group_size}")
    if rewards_b.dim() != 1 or rewards_b.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
            f"got shape {tuple(rewards_b.shape)}"
        )
    rewards_b = rewards_b.detach()
    grouped_pg = rewards_b.view(-1, group_size)
    centred_b = (grouped_pg - grouped_pg.mean(dim=1, keepdim=True)).view(-1)
    if baseline == "leave_one_out":
        centred_b = centred_b * (group_size / (group_size - 1))
    elif baseline != "group_mean":
        raise ValueError(f"baseline {baseline!r} is unknown; valid: {', '.join(BASELINES)}")
    if scale_rewards == "none":
        return centred_b
    if scale_rewards == "group":
        std_b = grouped_pg.std(dim=1, keepdim=True).expand_as(grouped_pg).reshape(-1)
    elif scale_rewards == "batch":
        std_b = rewards_b.std().expand_as(rewards_b)
    else:
        raise ValueError(f"scale_rewards {scale_rewards!r} is unknown; valid: {', '.join(SCALE_REWARDS)}")
    return centred_b / (std_b + _STD_EPS)


def _rows(mask_bt: torch.Tensor) -> int:
    return mask_bt.shape[0]


def token_mean_weights(
    mask_bt: torch.Tensor, *, num_tokens: float | None = None, max_len: int | None = None
) -> torch.Tensor:
    """``m / N``: every real token counts the same (DAPO). ``N`` is this batch's token count unless
    ``num_tokens`` gives the count of the whole batch that micro-batches are accumulated into."""
    count = mask_bt.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=mask_bt.dtype)
    return mask_bt / count.clamp_min(1.0)


def seq_mean_token_mean_weights(
    mask_bt: torch.Tensor, *, num_tokens: float | None = None, max_len: int | None = None
) -> torch.Tensor:
    """``m / (B * |o_i|)``: each response's token mean, averaged over responses (original GRPO)."""
    return mask_bt / (_rows(mask_bt) * mask_bt.sum(dim=-1, keepdim=True).clamp_min(1.0))


def seq_mean_token_sum_weights(
    mask_bt: torch.Tensor, *, num_tokens: float | None = None, max_len: int | None = None
) -> torch.Tensor:
    """``m / B``: each response's token sum, averaged over responses (verl's seq-mean-token-sum)."""
    return mask_bt / _rows(mask_bt)


def seq_mean_token_sum_norm_weights(
    mask_bt: torch.Tensor, *, num_tokens: float | None = None, max_len: int | None = None
) -> torch.Tensor:
    """``m / (B * max_len)``: token sums over a constant (Dr. GRPO); ``max_len`` defaults to the width
    of ``mask_bt``, and should be the generation's maximum response length."""
    width = mask_bt.shape[-1] if max_len is None else max_len
    if width < mask_bt.shape[-1]:
        raise ValueError(f"max_len={width} is shorter than the responses ({mask_bt.shape[-1]} tokens)")
    return mask_bt / (_rows(mask_bt) * width)


TokenWeights = Callable[..., torch.Tensor]
# name -> token weights, verl's loss_agg_mode names; AlgorithmConfig accepts exactly these names.
LOSS_AGGREGATIONS: dict[str, TokenWeights] = {
    "token-mean": token_mean_weights,
    "seq-mean-token-mean": seq_mean_token_mean_weights,
    "seq-mean-token-sum": seq_mean_token_sum_weights,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm_weights,
}
# TRL's GRPOConfig.loss_type -> the aggregation that equals it (its clipped loss types only).
TRL_LOSS_TYPES: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


def _weighted_surrogate(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    adv_bt: torch.Tensor,
    weights_bt: torch.Tensor,
    clip_ratio: float,
) -> LossAndStats:
    # ppo.policy_loss returns sum(x * w) / sum(w); multiplying by sum(w) leaves sum(x * w).
    loss, stats = policy_loss(logp_bt, old_logp_bt, adv_bt, weights_bt, clip_ratio)
    total = weights_bt.sum()
    return loss * total, {name: value * total for name, value in stats.items()}


def grpo_loss(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    advantages_b: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    ref_logp_bt: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLKind = "k3",
    kl_ratio_weighted: bool = False,
    num_tokens: float | None = None,
    max_len: int | None = None,
) -> LossAndStats:
    """GRPO's clipped policy loss plus ``kl_coef`` times the KL to the reference, aggregated alike.

    ``advantages_b`` is one advantage per response (``[b]``, from ``group_advantages``) or per token
    (``[b, t]``). ``epsilon_high`` (None: ``epsilon``) is DAPO's clip-higher. ``num_tokens`` and
    ``max_len`` feed the aggregation (see LOSS_AGGREGATIONS). Stats (detached 0-dim tensors):
    ``clip_frac``, ``approx_kl``, ``ratio_mean`` weighted as the loss weighs tokens, and ``kl``
    (token-mean of the estimator) when a KL term is used.
    """
    if loss_agg_mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is unknown; valid: {', '.join(LOSS_AGGREGATIONS)}")
    weights_bt = LOSS_AGGREGATIONS[loss_agg_mode](mask_bt, num_tokens=num_tokens, max_len=max_len)
    adv_bt = advantages_b[:, None].expand_as(logp_bt) if advantages_b.dim() == 1 else advantages_b
    positive_bt = (adv_bt > 0).to(weights_bt.dtype)
    high = epsilon if epsilon_high is None else epsilon_high
    loss_hi, stats_hi = _weighted_surrogate(logp_bt, old_logp_bt, adv_bt, weights_bt * positive_bt, high)
    loss_lo, stats_lo = _weighted_surrogate(
        logp_bt, old_logp_bt, adv_bt, weights_bt * (1 - positive_bt), epsilon
    )
    loss = loss_hi + loss_lo
    with torch.no_grad():
        total = weights_bt.sum().clamp_min(1e-8)
        stats = {name: (stats_hi[name] + stats_lo[name]) / total for name in stats_hi}
    if kl_coef != 0.0:
        if ref_logp_bt is None:
            raise ValueError(f"kl_coef={kl_coef} needs ref_logp_bt, the reference model's log-probs")
        kl_bt = kl_penalty(logp_bt, ref_logp_bt, kl_estimator)
        with torch.no_grad():
            stats["kl"] = masked_mean(kl_bt, mask_bt)
        if kl_ratio_weighted:
            kl_bt = kl_bt * torch.exp(logp_bt - old_logp_bt)
        loss = loss + kl_coef * (kl_bt * weights_bt).sum()
    return loss, stats


__all__ = [
    "BASELINES",
    "LOSS_AGGREGATIONS",
    "SCALE_REWARDS",
    "TRL_LOSS_TYPES",
    "Baseline",
    "ScaleRewards",
    "group_advantages",
    "grpo_loss",
    "seq_mean_token_mean_weights",
    "seq_mean_token_sum_norm_weights",
    "seq_mean_token_sum_weights",
    "token_mean_weights",
]
