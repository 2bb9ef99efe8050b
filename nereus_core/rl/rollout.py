"""The rollout batch of one PPO or GRPO step: the one data type that moves between stages.

Alignment: a sequence is ``ids = prompt ++ response`` of length ``s = P + T``.
The lm head gives ``logp[:, j] = log p(ids[:, j+1] | ids[:, :j+1])`` for
``j < s-1``, so the response's log-probs are its last ``T`` columns. The value
head gives ``values[:, j]`` for the state after ``ids[:, :j+1]``; the value of
the state in which response token ``i`` is chosen is ``values[:, P-1+i]``,
i.e. columns ``s-T-1 .. s-2``. The objectives below take the head's full
outputs (as the engine computes them) and slice the response out.

Padding, as verl: prompts are left-padded (``prompt_mask`` 0 on the pads) and responses
right-padded (``mask`` 1 up to and including the stop token, 0 after), so the alignment above
holds for every row. ``attention_mask`` is both masks side by side; every loss, estimator and
statistic reads only the tokens ``mask`` marks.
Responses are cut to the batch's longest one (``cut_to_longest``) before any pass: the columns
after every row's end are pads that no pass, loss or statistic reads (TRL's GRPOTrainer pads
completions to the batch's longest one alike), so ``T`` is that length, at most the generation's
max new tokens.
GRPO's batch is ``prompts * group_size`` rows, the ``group_size`` responses to one prompt next to
each other (``grouped``); its advantages are one per response (``grpo.group_advantages``) spread over
the response's tokens, so the rollout keeps one type and the train stage one batch layout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from nereus_core.rl import grpo, ppo
from nereus_core.rl.grpo import GroupSettings


@dataclass
class Rollout:
    """Per-sequence tensors of one step; every field's first dim is the batch."""

    prompts: torch.Tensor  # [b, P] token ids, left-padded
    responses: torch.Tensor  # [b, T] token ids, right-padded
    mask: torch.Tensor  # [b, T] 1.0 for real response tokens (up to and including the stop token)
    prompt_mask: torch.Tensor | None = None  # [b, P] 1 for real prompt tokens; None: no padding
    rule_score: torch.Tensor | None = None  # [b] the task's verifiable score
    score: torch.Tensor | None = None  # [b] the reward model's score
    old_logp: torch.Tensor | None = None  # [b, T] actor log-probs at rollout time
    # [b, T] the rollout engine's own log-probs of the sampled tokens (vLLM's; kept beside old_logp,
    # which the train layout recomputes, as verl does, so that a mismatch between the two shows)
    rollout_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  # [b, T] reference log-probs
    values: torch.Tensor | None = None  # [b, T] critic values at rollout time
    rewards: torch.Tensor | None = None  # [b, T] KL-shaped rewards
    advantages: torch.Tensor | None = None  # [b, T]
    returns: torch.Tensor | None = None  # [b, T]

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.responses], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """``[b, P + T]``: 1 for the real tokens of ``ids``, 0 for the pads on either side."""
        prompt_mask = torch.ones_like(self.prompts) if self.prompt_mask is None else self.prompt_mask
        return torch.cat([prompt_mask.to(self.mask.dtype), self.mask], dim=1)

    @property
    def response_len(self) -> int:
        """The response columns ``T`` (the max new tokens, or the longest response once cut by
        ``cut_to_longest``); a row's own length is in ``lengths``."""
        return self.responses.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """Each response's real tokens ``[b]`` (int64)."""
        return self.mask.sum(dim=1).round().long()

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """Each prompt's real tokens ``[b]`` (int64): its width where it has no padding."""
        if self.prompt_mask is None:
            return torch.full((self.prompts.shape[0],), self.prompts.shape[1], dtype=torch.long)
        return self.prompt_mask.sum(dim=1).round().long()

    def columns(self) -> dict[str, torch.Tensor]:
        """The filled fields, by name, and each response's length (for the rollouts table)."""
        filled = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return {**filled, "response_length": self.lengths}

    def train_batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the train stages need for the given rows: ids and their attention mask plus
        response-aligned targets."""
        mask = self.mask[rows]
        batch = {
            "ids": self.ids[rows],
            "attention_mask": self.attention_mask[rows],
            "mask": mask,
            # Each row carries the mini-batch's real tokens per row (ppo.minibatch_share).
            "tokens_per_row": (mask.sum() / mask.shape[0]).expand(mask.shape[0]).clone(),
        }
        for name in ("old_logp", "ref_logp", "values", "advantages", "returns"):
            value = getattr(self, name)
            if value is not None:
                batch[name] = value[rows]
        return batch


# The fields aligned with the response columns ``[b, T]``: what ``cut_to_longest`` cuts.
RESPONSE_FIELDS = (
    "responses",
    "mask",
    "old_logp",
    "rollout_logp",
    "ref_logp",
    "values",
    "rewards",
    "advantages",
    "returns",
)


def cut_to_longest(r: Rollout) -> Rollout:
    """``r`` with its response columns cut to its longest response (at least one column): the
    columns after it hold only pads (``mask`` 0 on every row), so every pass, loss and statistic
    gives the same on the cut rollout and computes less. A rollout already that wide is returned
    as is."""
    width = max(int(r.lengths.max()), 1) if r.mask.numel() else r.response_len
    if width >= r.response_len:
        return r
    cut = {name: getattr(r, name)[:, :width] for name in RESPONSE_FIELDS if getattr(r, name) is not None}
    return replace(r, **cut)


def response_logp(logp_full: torch.Tensor, response_len: int) -> torch.Tensor:
    """The response's log-probs ``[b, T]`` from the lm head's ``[b, s-1]``."""
    return logp_full[:, -response_len:]


def response_values(values_full: torch.Tensor, response_len: int) -> torch.Tensor:
    """The values of the states choosing each response token ``[b, T]`` from the value head's ``[b, s]``."""
    return values_full[:, -response_len - 1 : -1]


def final_score(values_full: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The reward model's score of a sequence: its value after its last real token ``[b]``."""
    return ppo.last_value(values_full, attention_mask)


@dataclass(frozen=True)
class Stopping:
    """When a response ends: at its first id in ``eos_ids`` (kept, mask 1) or at the max new tokens;
    ``pad_id`` fills the columns after. No stop ids: every response is exactly the max new tokens
    (the ``count`` task). A tokenizer supplies both for real models."""

    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def __post_init__(self) -> None:
        if any(i < 0 for i in self.eos_ids) or self.pad_id < 0:
            raise ValueError(f"token ids must be >= 0, got eos_ids={self.eos_ids}, pad_id={self.pad_id}")


# The count task's stopping: none, every response runs to the max new tokens.
NO_STOP = Stopping()


def response_mask(responses_bt: torch.Tensor, eos_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """``[b, T]`` float: 1 up to and including each row's first id in ``eos_ids``, 0 after (verl's
    ``get_response_mask``); all ones without stop ids. Pads are not looked at, so ``pad_id`` may be
    a stop id."""
    if not eos_ids:
        return torch.ones(responses_bt.shape, dtype=torch.float32)
    stops_bt = torch.isin(responses_bt, torch.tensor(eos_ids, dtype=responses_bt.dtype)).long()
    stops_before_bt = stops_bt.cumsum(dim=1) - stops_bt
    return (stops_before_bt == 0).float()


def token_rewards(rollout: Rollout, settings: ppo.PPOConfig) -> torch.Tensor:
    """``[b, T]``: each response's score on its last real token, less ``settings.kl_coef`` times the
    per-token KL to the reference (``ppo.shaped_rewards``) when ``kl_coef`` > 0; without a KL penalty
    the old log-probs are not read (they may be unset: ``Algorithm.reuses_old_logp``)."""
    score_b, mask_bt = rollout.score, rollout.mask
    if settings.kl_coef > 0:
        return ppo.shaped_rewards(
            score_b, rollout.old_logp, rollout.ref_logp, mask_bt, settings.kl_coef, settings.kl_kind
        )
    no_kl_bt = torch.zeros_like(mask_bt)  # KL(p || p) = 0 under every estimator
    return ppo.shaped_rewards(score_b, no_kl_bt, no_kl_bt, mask_bt, 0.0)


def compute_advantages(rollout: Rollout, settings: ppo.PPOConfig) -> None:
    """Fill rewards, advantages and returns (KL-shaped reward, GAE, optional whitening)."""
    rollout.rewards = token_rewards(rollout, settings)
    estimator = ppo.ADVANTAGE_ESTIMATORS[settings.advantage_estimator]
    advantages, returns = estimator(
        rollout.rewards, rollout.values, rollout.mask, settings.gamma, settings.lam
    )
    if settings.whiten_advantages:
        advantages = ppo.masked_whiten(advantages, rollout.mask)
    rollout.advantages, rollout.returns = advantages, returns


def grouped(prompts_pp: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each prompt ``group_size`` times, the copies next to each other: ``[p * group_size, P]``."""
    return prompts_pp.repeat_interleave(group_size, dim=0)


def compute_group_advantages(rollout: Rollout, algorithm: GroupSettings, settings: ppo.PPOConfig) -> None:
    """Fill rewards and advantages for GRPO: a response's reward is its score minus, with
    ``settings.kl_coef`` > 0, the KL penalty summed over its tokens (verl's ``use_kl_in_reward``:
    token rewards from ``ppo.shaped_rewards``, summed per response); its advantage is
    ``grpo.group_advantages`` of those rewards, the same on every real token. No returns: no critic."""
    mask_bt = rollout.mask
    rewards_bt = token_rewards(rollout, settings)
    advantages_b = grpo.group_advantages(
        rewards_bt.sum(dim=1),
        algorithm.group_size,
        scale_rewards=algorithm.scale_rewards,  # type: ignore[arg-type]
        baseline=algorithm.baseline,  # type: ignore[arg-type]
    )
    rollout.rewards, rollout.advantages = rewards_bt, advantages_b[:, None] * mask_bt


def _actor_stats(
    loss_stats: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], share: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The actor objectives' statistics, each weighted as the loss (``share``): ``clip_frac``,
    ``approx_kl``, ``kl_loss`` when the loss has a KL term, ``entropy`` when the batch has it."""
    mask = batch["mask"]
    stats = {"clip_frac": loss_stats["clip_frac"], "approx_kl": loss_stats["approx_kl"]}
    if "kl" in loss_stats:
        stats["kl_loss"] = loss_stats["kl"]
    if "entropy" in batch:
        stats["entropy"] = ppo.masked_mean(response_logp(batch["entropy"], mask.shape[1]), mask)
    return {k: v * share for k, v in stats.items()}


def grpo_objective(
    logp_full: torch.Tensor,
    batch: dict[str, torch.Tensor],
    *,
    settings: ppo.PPOConfig,
    algorithm: GroupSettings,
) -> ppo.LossAndStats:
    """The actor's GRPO loss on a micro-batch (``grpo.grpo_loss``): the clipped surrogate with
    ``settings.clip_ratio`` (and DAPO's ``algorithm.clip_ratio_high``), aggregated over tokens as
    ``algorithm.loss_agg_mode`` says, plus the KL loss term when ``settings.use_kl_loss``. The engine
    averages micro-batches of equal rows, which gives the mini-batch's mean over sequences for the
    seq-mean modes; token-mean is taken as the micro-batch's share of the mini-batch's token-mean
    (``ppo.minibatch_share``, as the PPO objective), so ragged masks weigh every token alike in every
    layout (TRL's and verl's token normalisation over the accumulated batch). Statistics as
    ``actor_objective``'s, plus ``kl_loss`` (the KL estimate) with the KL term."""
    mask = batch["mask"]
    token_mean = algorithm.loss_agg_mode == "token-mean"
    share = ppo.minibatch_share(mask, batch.get("tokens_per_row")) if token_mean else mask.new_ones(())
    logp = response_logp(logp_full, mask.shape[1])
    kl = settings.use_kl_loss
    loss, loss_stats = grpo.grpo_loss(
        logp,
        batch["old_logp"],
        batch["advantages"],
        mask,
        loss_agg_mode=algorithm.loss_agg_mode,
        epsilon=settings.clip_ratio,
        epsilon_high=algorithm.clip_ratio_high,
        ref_logp_bt=batch["ref_logp"] if kl else None,
        kl_coef=settings.kl_loss_coef if kl else 0.0,
        kl_estimator=settings.kl_loss_kind,
        kl_ratio_weighted=algorithm.kl_ratio_weighted,
        max_len=algorithm.loss_scale_tokens or mask.shape[1],
    )
    return loss * share, _actor_stats(loss_stats, batch, share)


def actor_objective(
    logp_full: torch.Tensor, batch: dict[str, torch.Tensor], *, settings: ppo.PPOConfig
) -> ppo.LossAndStats:
    """The actor's loss on a micro-batch: PPO's clipped surrogate (+ KL loss when enabled), as its
    share of the mini-batch's token-mean (``ppo.minibatch_share``) when the batch says its size.

    Statistics (verl's names in brackets): ``clip_frac`` (pg_clipfrac), ``approx_kl`` (ppo_kl) and,
    when the engine put the policy's per-token entropy in ``batch['entropy']``, ``entropy``: each a
    token-mean over the real response tokens, weighted as the loss.
    """
    mask = batch["mask"]
    share = ppo.minibatch_share(mask, batch.get("tokens_per_row"))
    logp = response_logp(logp_full, mask.shape[1])
    loss, loss_stats = ppo.POLICY_LOSSES[settings.policy_loss](
        logp, batch["old_logp"], batch["advantages"], mask, settings.clip_ratio
    )
    if settings.use_kl_loss:
        loss = loss + settings.kl_loss_coef * ppo.kl_loss(
            logp, batch["ref_logp"], mask, settings.kl_loss_kind
        )
    return loss * share, _actor_stats(loss_stats, batch, share)


def critic_objective(
    values_full: torch.Tensor, batch: dict[str, torch.Tensor], *, settings: ppo.PPOConfig
) -> ppo.LossAndStats:
    """The critic's loss on a micro-batch: clipped value loss against the returns, weighted as the
    actor's; statistic ``value_clip_frac`` (verl's vf_clipfrac)."""
    mask = batch["mask"]
    share = ppo.minibatch_share(mask, batch.get("tokens_per_row"))
    values = response_values(values_full, mask.shape[1])
    loss, loss_stats = ppo.VALUE_LOSSES[settings.value_loss](
        values, batch["values"], batch["returns"], mask, settings.value_clip
    )
    return loss * share, {"value_clip_frac": loss_stats["value_clip_frac"] * share}


def engine_logp_gap(r: Rollout) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the train layout's old ones, over the real
    response tokens: ``rollout_logp_diff_max`` and ``_mean`` (nothing when the engine gave none)."""
    if r.rollout_logp is None or r.old_logp is None:
        return {}
    gap_bt = (r.rollout_logp - r.old_logp).abs() * r.mask
    real = r.mask.sum().clamp_min(1.0)
    return {
        "rollout_logp_diff_max": float(gap_bt.max()),
        "rollout_logp_diff_mean": float(gap_bt.sum() / real),
    }


def length_stats(mask_bt: torch.Tensor, limit: int) -> dict[str, float]:
    """Generated response lengths of a batch from its response mask ``[b, T]`` (1 for a generated
    token): ``response_len_mean``, ``response_len_max`` and ``response_clip_frac``, the share of
    sequences that reached ``limit`` (the max new tokens) instead of ending on their own."""
    if mask_bt.dim() != 2 or mask_bt.shape[0] == 0:
        raise ValueError(
            f"response mask must be [batch, tokens] with batch >= 1, got shape {tuple(mask_bt.shape)}"
        )
    if limit < 1:
        raise ValueError(f"limit={limit} must be the rollout's max new tokens (>= 1)")
    lengths_b = mask_bt.sum(dim=1).double()
    longest = float(lengths_b.max())
    if longest > limit:
        raise ValueError(
            f"a response has {longest:g} tokens, above limit={limit}; pass the rollout's max new tokens"
        )
    return {
        "response_len_mean": float(lengths_b.mean()),
        "response_len_max": longest,
        "response_clip_frac": float((lengths_b >= limit).double().mean()),
    }


def minibatch_rows(
    batch: int, mini_batches: int, generator: torch.Generator, group_size: int = 1
) -> list[torch.Tensor]:
    """A seeded shuffle of the rows split into ``mini_batches`` equal parts; with ``group_size`` > 1
    the groups of consecutive rows are shuffled and kept whole (GRPO: a prompt's responses train in
    one optimizer step). ``group_size`` 1 is a plain shuffle of the rows."""
    if batch % (group_size * mini_batches):
        raise ValueError(
            f"batch {batch} is not divisible into mini_batches={mini_batches} of whole groups of {group_size}"
        )
    order = torch.randperm(batch // group_size, generator=generator)
    rows = (order[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    return list(rows.view(mini_batches, -1))
