"""PPO math: pure tensor functions, chosen by name from config.

Boundary: tensors in, tensors out. No models, optimizers, processes or files; the engines
compute log-probs and values, the job decides when to call what. Every tensor over response
tokens is ``[b, t]`` with a float ``mask_bt`` (1 for a real response token, 0 for padding).

What is followed, and from where:

- Policy loss: the clipped surrogate of PPO (Schulman et al. 2017, arXiv:1707.06347, eq. 7),
  ``L = E_t[max(-A_t r_t, -A_t clip(r_t, 1-eps, 1+eps))]`` with ``r_t = pi(a_t|s_t) / pi_old(a_t|s_t)``,
  averaged over all real tokens of the mini-batch (token-mean, the verl/OpenRLHF default).
- Advantages: GAE (Schulman et al. 2016, arXiv:1506.02438, eq. 16), computed backwards in time:
  ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``, with the value after
  the last real token taken as 0 (the episode ends there) and returns ``R_t = A_t + V_t`` as the
  critic's target. Padding inside a row is skipped, as in verl's masked GAE.
- Reward: the RLHF reward shaped by a per-token KL penalty against the reference model
  (Ziegler et al. 2019, arXiv:1909.08593; Ouyang et al. 2022, arXiv:2203.02155, eq. 2):
  every token gets ``-kl_coef * KL_t``, and the last real token also gets the sequence score.
- KL estimators from samples of the policy (Schulman, "Approximating KL divergence", 2020), with
  ``log r = ref_logp - logp``: k1 = ``-log r`` (unbiased, can be negative), k2 = ``(log r)^2 / 2``,
  k3 = ``(r - 1) - log r`` (unbiased and never negative), abs = ``|log r|``.
- KL as a loss instead of a reward term (GRPO, Shao et al. 2024, arXiv:2402.03300, eq. 4): the
  token-mean of the k3 estimator, added to the policy loss with its own coefficient.
- Value loss: the clipped value loss of OpenAI baselines' ppo2 as used by verl and OpenRLHF,
  ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``, token-mean.
- Whitening: subtract the masked mean and divide by the masked standard deviation with the
  unbiased (n - 1) variance, as verl's and TRL's ``masked_whiten`` do.

The registries at the bottom map the names used in config to these functions, as verl's
``core_algos.py`` does, so a new estimator or loss is one function and one entry.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Annotated, Literal, get_args

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

KLKind = Literal["k1", "k2", "k3", "abs"]
KL_KINDS: tuple[str, ...] = get_args(KLKind)

_EPS = 1e-8
# exp() of a log-ratio beyond this overflows float32 long before it means anything.
_MAX_LOG_RATIO = 20.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)`` over ``dim`` (all dims when None); 0 where the mask is empty."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(_EPS)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(_EPS)


def minibatch_share(mask_bt: torch.Tensor, tokens_per_row: torch.Tensor | None) -> torch.Tensor:
    """What turns a micro-batch's token-mean into its share of the mini-batch's token-mean.

    The engine averages micro-batch losses over micro-batches and replicas (DeepSpeed's 1/GAS and
    DP mean). With ragged masks a mean of per-micro-batch token-means weights a token by the length
    of its micro-batch, so the gradient would depend on the layout. Multiplying each micro-batch's
    token-mean by ``sum(mask) / (rows * tokens_per_row)``, where ``tokens_per_row`` is the mini-batch's
    real tokens per row, makes that average the token-mean over the whole mini-batch (as verl's
    global token normalization) in every layout. Exactly 1 when every row has the same length, and
    when ``tokens_per_row`` is None (a plain per-micro-batch mean).
    """
    if tokens_per_row is None:
        return mask_bt.new_ones(())
    return mask_bt.sum() / (mask_bt.shape[0] * tokens_per_row.reshape(-1)[0].to(mask_bt.dtype))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of ``x``; unbiased (Bessel's ``n / (n - 1)``) by default."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = float(mask.sum())
        if n <= 1:
            raise ValueError(f"unbiased variance needs at least 2 masked entries, got mask sum {n:g}")
        var = var * (n / (n - 1))
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` over the masked entries, with the unbiased variance.

    With ``shift_mean=False`` the mean is added back (only the scale changes), as verl and TRL
    do for rewards. Padded entries come out as 0.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + _EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def kl_penalty(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy.

    ``kind``: k1 ``logp - ref``; k2 ``(logp - ref)^2 / 2``; k3 ``exp(ref - logp) - (ref - logp) - 1``;
    abs ``|logp - ref|`` (Schulman 2020; the names verl uses). For k3 the log-ratio is clamped to
    ``[-20, 20]`` before ``exp`` so a far-off token cannot overflow.
    """
    log_ratio = logp_bt - ref_logp_bt
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        neg = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(neg) - neg - 1.0
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"kl kind {kind!r} is unknown; valid: {', '.join(KL_KINDS)}")


def last_token_index(mask_bt: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row, ``[b]``; -1 for a row with none."""
    positions = torch.arange(mask_bt.shape[-1], device=mask_bt.device).expand_as(mask_bt)
    return torch.where(mask_bt > 0, positions, torch.full_like(positions, -1)).amax(dim=-1)


def last_value(values_bs: torch.Tensor, attention_mask_bs: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's value at its last real token ``[b]`` (the last column without a mask): where a
    reward model reads the score of a right-padded sequence, as verl's reward model does. When every
    row ends on a real token that is the last column, read as a slice (bit for bit as without a mask)."""
    if attention_mask_bs is None or bool(attention_mask_bs[:, -1].all()):
        return values_bs[:, -1]
    last_b = last_token_index(attention_mask_bs.to(values_bs.device)).clamp_min(0)
    return values_bs.gather(1, last_b[:, None]).squeeze(1)


def shaped_rewards(
    score_b: torch.Tensor,
    logp_bt: torch.Tensor,
    ref_logp_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    kl_coef: float,
    kind: KLKind = "k1",
) -> torch.Tensor:
    """Per-token rewards ``-kl_coef * KL_t``, plus ``score_b`` at each row's last real token.

    Ziegler et al. 2019 / Ouyang et al. 2022: the sequence score is the reward of the final
    action; the KL penalty keeps every token near the reference. Padded tokens get 0, and a row
    without real tokens gets no score.
    """
    rewards_bt = -kl_coef * kl_penalty(logp_bt, ref_logp_bt, kind) * mask_bt
    last_b = last_token_index(mask_bt)
    has_token_b = (last_b >= 0).to(rewards_bt.dtype)
    score_b = score_b.to(rewards_bt.dtype) * has_token_b
    return rewards_bt.scatter_add(1, last_b.clamp_min(0)[:, None], score_b[:, None])


@torch.no_grad()
def gae(
    rewards_bt: torch.Tensor,
    values_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation; returns ``(advantages_bt, returns_bt)``.

    Backwards over t: ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``,
    where "next" is the next *real* token (padding is passed over, carrying V_next and A_next
    unchanged) and is 0 after the last one. ``returns = advantages + values``. No gradient flows:
    both are targets. Padded entries come out as 0.
    """
    b, t = rewards_bt.shape
    next_value = rewards_bt.new_zeros(b)
    next_adv = rewards_bt.new_zeros(b)
    advantages_bt = torch.zeros_like(rewards_bt)
    for i in reversed(range(t)):
        m = mask_bt[:, i]
        delta = rewards_bt[:, i] + gamma * next_value - values_bt[:, i]
        adv = delta + gamma * lam * next_adv
        advantages_bt[:, i] = adv * m
        next_value = m * values_bt[:, i] + (1 - m) * next_value
        next_adv = m * adv + (1 - m) * next_adv
    returns_bt = (advantages_bt + values_bt) * mask_bt
    return advantages_bt, returns_bt


def policy_loss(
    logp_bt: torch.Tensor,
    old_logp_bt: torch.Tensor,
    advantages_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    clip_ratio: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7), token-mean over real tokens.

    Per token ``max(-A * r, -A * clip(r, 1 - clip_ratio, 1 + clip_ratio))``, ``r = exp(logp - old_logp)``.
    When the clipped term wins, the loss is constant in ``logp`` there: no gradient pushes the
    ratio further out of the trust region. The log-ratio is clamped to ``[-20, 20]`` against
    overflow. Stats, as verl's ``compute_policy_loss`` (detached 0-dim tensors, so a caller on an
    accelerator converts once per step, not per micro-batch): ``clip_frac`` (verl's pg_clipfrac:
    share of real tokens where the clipped term wins), ``approx_kl`` (verl's ppo_kl: masked mean
    of ``old_logp - logp``, the k1 estimate of KL(old || new)), ``ratio_mean``.
    """
    log_ratio = (logp_bt - old_logp_bt).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages_bt * ratio
    clipped = -advantages_bt * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask_bt)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).to(mask_bt.dtype), mask_bt),
            "approx_kl": masked_mean(old_logp_bt - logp_bt, mask_bt),
            "ratio_mean": masked_mean(ratio, mask_bt),
        }
    return loss, stats


def value_loss(
    values_bt: torch.Tensor,
    old_values_bt: torch.Tensor,
    returns_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``, token-mean over real tokens.

    ``V_clip = V_old + clip(V - V_old, -clip_range, clip_range)`` keeps the critic near the values
    the advantages were computed with (OpenAI baselines ppo2; verl, OpenRLHF). Stats (detached
    0-dim tensors): ``value_clip_frac`` (verl's vf_clipfrac: share of real tokens where the clipped
    error wins), ``value_mean``, ``mse`` (unclipped mean squared error).
    """
    v_clipped = old_values_bt + (values_bt - old_values_bt).clamp(-clip_range, clip_range)
    err = (values_bt - returns_bt).square()
    err_clipped = (v_clipped - returns_bt).square()
    loss = 0.5 * masked_mean(torch.maximum(err, err_clipped), mask_bt)
    with torch.no_grad():
        stats = {
            "value_clip_frac": masked_mean((err_clipped > err).to(mask_bt.dtype), mask_bt),
            "value_mean": masked_mean(values_bt, mask_bt),
            "mse": masked_mean(err, mask_bt),
        }
    return loss, stats


def kl_loss(
    logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor, mask_bt: torch.Tensor, kind: KLKind = "k3"
) -> torch.Tensor:
    """Token-mean KL(policy || reference) as a loss term (GRPO, Shao et al. 2024); k3 by default."""
    return masked_mean(kl_penalty(logp_bt, ref_logp_bt, kind), mask_bt)


AdvantageEstimator = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]
]
# A loss and its statistics (detached 0-dim tensors, named as verl names them).
LossAndStats = tuple[torch.Tensor, dict[str, torch.Tensor]]
PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], LossAndStats]
ValueLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], LossAndStats]

# name -> function, as verl's core_algos registries; PPOConfig accepts exactly these names.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {"gae": gae}
POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo_clip": policy_loss}
VALUE_LOSSES: dict[str, ValueLoss] = {"clipped_mse": value_loss}


def known_name(name: str, registry: Collection[str]) -> str:
    """``name`` if ``registry`` has it, else ``ValueError`` listing the valid names (the config layer
    prefixes the field's path, so the message does not repeat it)."""
    if name not in registry:
        raise ValueError(f"{name!r} is unknown; valid: {', '.join(registry)}")
    return name


def one_of(registry: Collection[str]) -> AfterValidator:
    """A config field's check that its value is a name in ``registry`` (``known_name``); annotate
    the field ``Annotated[str, one_of(REGISTRY)]``."""
    return AfterValidator(lambda name: known_name(name, registry))


class PPOConfig(BaseModel):
    """PPO hyper-parameters; defaults suit the tiny demo model on the ``count`` task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    advantage_estimator: Annotated[str, one_of(ADVANTAGE_ESTIMATORS)] = Field(
        default="gae", description="Name in ADVANTAGE_ESTIMATORS."
    )
    policy_loss: Annotated[str, one_of(POLICY_LOSSES)] = Field(
        default="ppo_clip", description="Name in POLICY_LOSSES."
    )
    value_loss: Annotated[str, one_of(VALUE_LOSSES)] = Field(
        default="clipped_mse", description="Name in VALUE_LOSSES."
    )
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount per token (GAE).")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE lambda: bias (0) vs variance (1).")
    clip_ratio: float = Field(default=0.2, gt=0, lt=1, description="PPO clip: ratio kept in [1-c, 1+c].")
    value_clip: float = Field(default=0.2, gt=0, description="Values kept within +-c of the old values.")
    kl_coef: float = Field(default=0.05, ge=0, description="Weight of the per-token KL reward penalty.")
    kl_kind: KLKind = Field(default="k1", description="KL estimator of the reward penalty.")
    use_kl_loss: bool = Field(default=False, description="Add a KL loss term (GRPO-style) to the actor.")
    kl_loss_coef: float = Field(default=0.0, ge=0, description="Weight of the KL loss term.")
    kl_loss_kind: KLKind = Field(default="k3", description="KL estimator of the KL loss term.")
    ppo_epochs: int = Field(default=2, ge=1, le=100, description="Passes over each rollout batch.")
    mini_batches: int = Field(default=2, ge=1, description="Optimizer steps per pass over the batch.")
    whiten_advantages: bool = Field(default=True, description="Whiten advantages over the batch.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature of the rollout.")
    actor_lr: float = Field(default=1e-3, gt=0, description="Actor AdamW learning rate.")
    critic_lr: float = Field(default=1e-3, gt=0, description="Critic AdamW learning rate.")
    grad_clip: float = Field(
        default=1.0,
        ge=0,
        le=1e6,
        description="Clip the global gradient norm of each actor and critic step to this (verl's "
        "actor.grad_clip and critic.grad_clip); 0: no clipping.",
    )
    reward_fit_steps: int = Field(
        default=300, ge=0, description="Supervised steps fitting the reward model to the rule score."
    )
    reward_fit_lr: float = Field(default=1e-3, gt=0, description="Learning rate of the reward-model fit.")
    reward_fit_batch: int = Field(default=64, ge=1, description="Sequences per reward-model fitting step.")

    @property
    def uses_kl(self) -> bool:
        """A KL term is used (a reward penalty or a loss term), so the reference model runs."""
        return self.kl_coef > 0 or self.use_kl_loss

    @model_validator(mode="after")
    def _check_kl_loss(self) -> PPOConfig:
        if self.use_kl_loss and self.kl_loss_coef == 0:
            raise ValueError(
                "use_kl_loss=true with kl_loss_coef=0 adds nothing; set kl_loss_coef > 0 (e.g. 0.001) "
                "or use_kl_loss: false"
            )
        return self


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_KINDS",
    "POLICY_LOSSES",
    "VALUE_LOSSES",
    "KLKind",
    "LossAndStats",
    "PPOConfig",
    "gae",
    "kl_loss",
    "kl_penalty",
    "last_token_index",
    "last_value",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "minibatch_share",
    "policy_loss",
    "shaped_rewards",
    "value_loss",
]
