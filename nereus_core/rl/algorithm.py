"""Which RL algorithm a job runs, and GRPO's own settings: the ``algorithm:`` section of a config.

Boundary: names and numbers only, validated when built; the valid algorithm names and what each
needs (a critic, a reference, a reward model, groups) are the registry's (``algorithms.py``); the
formulas live in ``grpo.py`` and ``ppo.py`` and accept exactly the names checked here (their
registries are the lists of valid names). The settings both algorithms share have one owner,
``PPOConfig`` (the ``ppo:`` section): ``clip_ratio`` (GRPO's ``epsilon``), ``ppo_epochs``,
``mini_batches``, the learning rates, the temperature, and the KL terms (``kl_coef``/``kl_kind``:
a penalty on the reward; ``use_kl_loss``, ``kl_loss_coef`` (TRL ``beta``), ``kl_loss_kind``: a loss
term). This section adds only what a critic-free algorithm needs. TRL's ``GRPOConfig`` names are
given in each description.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nereus_core.rl.algorithms import ALGORITHMS, Algorithm, algorithm
from nereus_core.rl.grpo import BASELINES, LOSS_AGGREGATIONS, SCALE_REWARDS
from nereus_core.rl.ppo import one_of


class AlgorithmConfig(BaseModel):
    """``ppo`` (actor, critic, GAE), ``grpo`` (no critic; advantages from groups of responses) or
    another entry of the registry (``algorithms.ALGORITHMS``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, one_of(ALGORITHMS)] = Field(
        default="ppo", description=f"One of: {', '.join(ALGORITHMS)}."
    )
    group_size: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Responses sampled per prompt (TRL num_generations); grpo needs at least 2.",
    )
    baseline: Annotated[str, one_of(BASELINES)] = Field(
        default="group_mean",
        description="group_mean (GRPO) or leave_one_out (RLOO): what a response's reward is compared to.",
    )
    scale_rewards: Annotated[str, one_of(SCALE_REWARDS)] = Field(
        default="group",
        description="Divide advantages by the reward std of the group, the batch, or none (TRL's name).",
    )
    loss_agg_mode: Annotated[str, one_of(LOSS_AGGREGATIONS)] = Field(
        default="token-mean",
        description=(
            "How token losses are averaged: token-mean (DAPO; TRL dapo/bnpo), seq-mean-token-mean "
            "(original GRPO; TRL grpo), seq-mean-token-sum-norm (Dr. GRPO; TRL dr_grpo), seq-mean-token-sum."
        ),
    )
    clip_ratio_high: float | None = Field(
        default=None,
        gt=0,
        lt=10,
        description="DAPO clip-higher: upper ratio clip (TRL epsilon_high); None: as clip_ratio.",
    )
    loss_scale_tokens: int | None = Field(
        default=None,
        ge=1,
        description="seq-mean-token-sum-norm's constant; None: the generation's maximum response length.",
    )
    kl_ratio_weighted: bool = Field(
        default=False,
        description="Weight the KL loss term by pi/pi_old, unbiased off-policy (TRL use_bias_correction_kl).",
    )

    @model_validator(mode="after")
    def _check_group(self) -> AlgorithmConfig:
        if self.entry.groups and self.group_size < 2:
            raise ValueError(
                f"{self.name} compares the responses to one prompt, so group_size must be at least 2 "
                f"(got {self.group_size}); 4 to 16 is usual"
            )
        if not self.entry.groups and self.group_size != 1:
            grouped = ", ".join(a.name for a in ALGORITHMS.values() if a.groups)
            raise ValueError(
                f"algorithm.group_size={self.group_size} is read by {grouped} only; "
                "set algorithm.name: grpo or drop group_size"
            )
        return self

    @property
    def entry(self) -> Algorithm:
        """The registry's entry of ``name``: its passes, estimator and objectives."""
        return algorithm(self.name)

    def batch_error(self, batch: int, mini_batches: int) -> str | None:
        """Why ``batch`` sequences per step cannot be sampled as whole groups and trained in
        ``mini_batches`` of whole groups (None if they can). Whole groups per mini-batch: GRPO's
        advantages are fixed before training, so this is not needed for correctness, but it keeps a
        prompt's responses in one optimizer step, as TRL's ``steps_per_generation`` batches do."""
        group = self.group_size
        if batch % group:
            return (
                f"job.batch_size={batch} is not a multiple of algorithm.group_size={group}: a step samples "
                f"{group} responses per prompt; choose a batch size that is a multiple of it"
            )
        if (batch // group) % mini_batches:
            return (
                f"job.batch_size/algorithm.group_size={batch // group} prompts do not split into "
                f"ppo.mini_batches={mini_batches} of whole groups; choose a batch size that is a multiple "
                f"of {group * mini_batches}"
            )
        return None

    @property
    def uses_critic(self) -> bool:
        """PPO trains a critic; GRPO does not (the entry's objectives say)."""
        return self.entry.uses_critic

    def uses_reference(self, *, kl: bool) -> bool:
        """PPO always runs the reference (its step reports the KL to it even without a KL term, and
        PPO runs have always held it); GRPO only when a KL term is used (``kl``)."""
        return self.entry.uses_reference(kl=kl)

    @property
    def uses_reward_model(self) -> bool:
        """Where the score comes from. PPO on the count task scores with the reward model fitted to
        the rule (the reward/infer stage; OpenRLHF-style); GRPO scores with the task's rule itself
        (verifiable rewards, as DeepSeekMath and TRL's reward functions): no reward model runs."""
        return self.entry.uses_reward_model


__all__ = ["ALGORITHMS", "AlgorithmConfig"]
