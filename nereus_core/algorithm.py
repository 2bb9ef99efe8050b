"""Which RL algorithm a job runs, and GRPO's own settings: the ``algorithm:`` section of a config.

Boundary: names and numbers only, validated when built; the formulas live in ``grpo.py`` and
``ppo.py`` and accept exactly the names checked here (their registries are the lists of valid
names). PPO's shared hyper-parameters (``clip_ratio`` as GRPO's ``epsilon``, ``ppo_epochs``,
``mini_batches``, learning rates) stay in ``PPOSettings``; this section adds what a critic-free
algorithm needs. TRL's ``GRPOConfig`` names are given in each description.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nereus_core.grpo import BASELINES, LOSS_AGGREGATIONS, SCALE_REWARDS
from nereus_core.ppo import KL_KINDS, known_name

ALGORITHMS: tuple[str, ...] = ("ppo", "grpo")


class AlgorithmConfig(BaseModel):
    """``ppo`` (actor, critic, GAE) or ``grpo`` (no critic; advantages from groups of responses)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="ppo", description=f"One of: {', '.join(ALGORITHMS)}.")
    group_size: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Responses sampled per prompt (TRL num_generations); grpo needs at least 2.",
    )
    baseline: str = Field(
        default="group_mean",
        description="group_mean (GRPO) or leave_one_out (RLOO): what a response's reward is compared to.",
    )
    scale_rewards: str = Field(
        default="group",
        description="Divide advantages by the reward std of the group, the batch, or none (TRL's name).",
    )
    loss_agg_mode: str = Field(
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
    kl_loss_coef: float = Field(
        default=0.0,
        ge=0,
        le=10,
        description="Weight of the KL-to-reference loss (TRL beta); 0: no reference.",
    )
    kl_estimator: str = Field(default="k3", description=f"KL estimator, one of: {', '.join(KL_KINDS)}.")
    kl_ratio_weighted: bool = Field(
        default=False,
        description="Weight the KL term by pi/pi_old, unbiased off-policy (TRL use_bias_correction_kl).",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        return known_name(name, ALGORITHMS)

    @field_validator("baseline")
    @classmethod
    def _check_baseline(cls, name: str) -> str:
        return known_name(name, BASELINES)

    @field_validator("scale_rewards")
    @classmethod
    def _check_scale(cls, name: str) -> str:
        return known_name(name, SCALE_REWARDS)

    @field_validator("loss_agg_mode")
    @classmethod
    def _check_agg(cls, name: str) -> str:
        return known_name(name, list(LOSS_AGGREGATIONS))

    @field_validator("kl_estimator")
    @classmethod
    def _check_kl(cls, name: str) -> str:
        return known_name(name, KL_KINDS)

    @model_validator(mode="after")
    def _check_group(self) -> AlgorithmConfig:
        if self.name == "grpo" and self.group_size < 2:
            raise ValueError(
                f"grpo compares the responses to one prompt, so group_size must be at least 2 "
                f"(got {self.group_size}); 4 to 16 is usual"
            )
        return self

    @property
    def uses_critic(self) -> bool:
        """PPO trains a critic; GRPO does not."""
        return self.name == "ppo"


__all__ = ["ALGORITHMS", "AlgorithmConfig"]
