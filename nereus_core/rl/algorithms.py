"""The RL algorithms a job can run, one registry entry each: what a step of the algorithm needs and does.

An entry (``Algorithm``) says, in the order a step uses them:

    passes      the forward passes over the rollout (model-stages), each with the rollout field its
                output fills: old log-probs (actor/train), reference log-probs (reference/infer),
                values (critic/infer), the reward model's score (reward/infer); without a score
                pass the rule's score is the reward
    estimator   the advantage estimator: fills the rollout's rewards, advantages (and returns)
    objectives  per train model-stage, its loss and the statistics it reports (``Objective``)

The job's model-stages follow from the entry (``uses_critic``, ``uses_reference``,
``uses_reward_model``; ``AlgorithmConfig`` asks it) and the job runs one generic step over it
(flows/job/rl_step.py), so a new algorithm is one ``register(Algorithm(...))`` here or in a test,
and a new estimator or loss one function, as verl's ``core_algos`` registries
(``register_adv_est``, ``register_policy_loss``). The formulas stay in ``ppo.py``, ``grpo.py`` and
``rollout.py``; this module only names which of them an algorithm uses.

- ``ppo``: PPO (Schulman et al. 2017, arXiv:1707.06347) with a critic and GAE (arXiv:1506.02438),
  scored by a reward model fitted to the rule (OpenRLHF-style) or by the rule on text.
- ``grpo``: GRPO (Shao et al. 2024, arXiv:2402.03300): no critic, advantages from the group of a
  prompt's responses, the rule as the reward; its variants (RLOO's baseline, Dr. GRPO's loss,
  DAPO's clip-higher) are ``algorithm:`` options (``AlgorithmConfig``), the same entry.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nereus_core.plan import ModelStage
from nereus_core.rl import ppo, rollout
from nereus_core.rl.grpo import GroupSettings
from nereus_core.rl.ppo import PPOConfig
from nereus_core.rl.rollout import Rollout

# What train returns for each model: the loss and the statistics verl logs per PPO step; GRPO's
# actor adds the KL loss term's estimate (verl's actor/kl_loss).
ACTOR_STATS = ("loss", "clip_frac", "approx_kl", "entropy", "grad_norm")
CRITIC_STATS = ("loss", "value_clip_frac", "grad_norm")
GRPO_ACTOR_STATS = (*ACTOR_STATS, "kl_loss")
# With the old log-prob pass reused (``current_as_old``), the actor's train step reports the KL to the
# reference that the step would otherwise take from the old log-probs (``masked_mean(old - ref)``).
REF_KL = "ref_kl"


@dataclass(frozen=True)
class Objective:
    """What a train stage minimises and reports: the loss of a mini-batch, the statistics kept, whether
    the policy's entropy is computed, and the group size whose groups mini-batches keep whole."""

    loss: Callable[..., Any]
    keys: tuple[str, ...]
    with_entropy: bool
    group_size: int = 1


def ppo_objective(settings: PPOConfig, *, critic: bool) -> Objective:
    """PPO's clipped policy loss (actor/train) or clipped value loss (critic/train)."""
    if critic:
        return Objective(functools.partial(rollout.critic_objective, settings=settings), CRITIC_STATS, False)
    return Objective(functools.partial(rollout.actor_objective, settings=settings), ACTOR_STATS, True)


def grpo_actor_objective(settings: PPOConfig, algorithm: GroupSettings) -> Objective:
    """GRPO's policy loss on group advantages, over mini-batches of whole groups."""
    loss = functools.partial(rollout.grpo_objective, settings=settings, algorithm=algorithm)
    return Objective(loss, GRPO_ACTOR_STATS, True, algorithm.group_size)


def ppo_actor(settings: PPOConfig, algorithm: GroupSettings) -> Objective:
    return ppo_objective(settings, critic=False)


def ppo_critic(settings: PPOConfig, algorithm: GroupSettings) -> Objective:
    return ppo_objective(settings, critic=True)


def current_as_old(
    logp_full: torch.Tensor, batch: dict[str, torch.Tensor], *, loss: Callable[..., Any]
) -> ppo.LossAndStats:
    """The actor objective ``loss`` with the current policy's log-probs, detached, as the old ones, as
    TRL's GRPOTrainer (``old_per_token_logps = per_token_logps.detach()`` when ``num_iterations`` is
    1): the ratio is 1 in value with its gradient intact, so the loss, its gradient and the update
    are those the old log-prob pass would give (it computes the same log-probs), and ``clip_frac``
    and ``approx_kl`` are 0, as TRL reports them then. With the reference's log-probs in ``batch``
    it adds ``REF_KL``: the token-mean of ``logp - ref_logp``, weighted as the loss (the step's KL)."""
    mask = batch["mask"]
    logp = rollout.response_logp(logp_full, mask.shape[1]).detach()
    out = loss(logp_full, {**batch, "old_logp": logp})
    value, stats = (out, {}) if isinstance(out, torch.Tensor) else out
    if "ref_logp" in batch:
        share = ppo.minibatch_share(mask, batch.get("tokens_per_row"))
        stats = {**stats, REF_KL: ppo.masked_mean(logp - batch["ref_logp"], mask) * share}
    return value, stats


def reusing_current_logp(objective: Objective) -> Objective:
    """``objective`` (actor/train's) on ``current_as_old``, reporting ``REF_KL`` too."""
    loss = functools.partial(current_as_old, loss=objective.loss)
    return dataclasses.replace(objective, loss=loss, keys=(*objective.keys, REF_KL))


# A forward pass's output (the head's full ``[b, s-1]`` log-probs or ``[b, s]`` values) into the
# rollout, ``response_len`` its response columns (``Rollout.response_len``).
Fill = Callable[[Rollout, torch.Tensor, int], None]


def fill_old_logp(r: Rollout, out: torch.Tensor, response_len: int) -> None:
    r.old_logp = rollout.response_logp(out, response_len)


def fill_ref_logp(r: Rollout, out: torch.Tensor, response_len: int) -> None:
    r.ref_logp = rollout.response_logp(out, response_len)


def fill_values(r: Rollout, out: torch.Tensor, response_len: int) -> None:
    r.values = rollout.response_values(out, response_len)


def fill_score(r: Rollout, out: torch.Tensor, response_len: int) -> None:
    r.score = rollout.final_score(out, r.attention_mask)


@dataclass(frozen=True)
class Pass:
    """A forward pass over the rollout: the model-stage that runs it and what its output fills."""

    stage: ModelStage
    fill: Fill


OLD_LOGP = Pass(ModelStage.ACTOR_TRAIN, fill_old_logp)  # on the train layout, as verl
REF_LOGP = Pass(ModelStage.REFERENCE_INFER, fill_ref_logp)
VALUES = Pass(ModelStage.CRITIC_INFER, fill_values)
SCORE = Pass(ModelStage.REWARD_INFER, fill_score)

# Fills the rollout's rewards and advantages (and returns, for a critic) from its filled fields; the
# job's ``algorithm:`` section (``AlgorithmConfig``; this module is below it) and ``ppo:`` settings.
Estimator = Callable[[Rollout, GroupSettings, PPOConfig], None]
# A train model-stage's objective under the job's settings.
ObjectiveOf = Callable[[PPOConfig, GroupSettings], Objective]


def gae_advantages(r: Rollout, algorithm: GroupSettings, settings: PPOConfig) -> None:
    """PPO's: KL-shaped token rewards, ``settings.advantage_estimator`` (GAE), optional whitening."""
    rollout.compute_advantages(r, settings)


def group_advantages(r: Rollout, algorithm: GroupSettings, settings: PPOConfig) -> None:
    """GRPO's: each response's reward against its group's (``algorithm.baseline``, ``scale_rewards``)."""
    rollout.compute_group_advantages(r, algorithm, settings)


@dataclass(frozen=True)
class Algorithm:
    """One RL algorithm: its forward passes (in the order they run; those the job's plan has run),
    its advantage estimator and its objectives per train model-stage. ``groups``: it samples
    ``group_size`` >= 2 responses per prompt (else exactly one); ``always_reference``: the job
    holds the reference even without a KL term (PPO reports the KL to it every step)."""

    name: str
    passes: tuple[Pass, ...]
    estimator: Estimator
    objectives: Mapping[ModelStage, ObjectiveOf]
    groups: bool = False
    always_reference: bool = False
    _stages: frozenset[ModelStage] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stages = frozenset(p.stage for p in self.passes) | frozenset(self.objectives)
        object.__setattr__(self, "_stages", stages)
        if ModelStage.ACTOR_TRAIN not in self.objectives or any(not s.trains for s in self.objectives):
            raise ValueError(
                f"algorithm {self.name!r}: objectives must be keyed by train model-stages and include "
                f"actor/train (got {', '.join(map(str, self.objectives)) or 'none'})"
            )

    @property
    def uses_critic(self) -> bool:
        return ModelStage.CRITIC_TRAIN in self._stages

    def uses_reference(self, *, kl: bool) -> bool:
        """Whether the job holds the reference: it is among the passes and, unless
        ``always_reference``, a KL term (``kl``) reads it."""
        return ModelStage.REFERENCE_INFER in self._stages and (self.always_reference or kl)

    @property
    def uses_reward_model(self) -> bool:
        """A reward/infer pass scores the responses; without one the rule's score is the reward."""
        return ModelStage.REWARD_INFER in self._stages

    def reuses_old_logp(self, settings: PPOConfig, *, engine_logp: bool) -> bool:
        """Whether the step skips the old log-prob pass (actor/train's forward before training) and
        the actor's loss takes the current log-probs, detached, as the old ones (``current_as_old``).

        The pass changes nothing then: the batch trains in one optimizer step (``ppo_epochs`` 1,
        ``mini_batches`` 1), so the only update starts from the weights the pass would run, as TRL's
        GRPOTrainer with ``num_iterations`` 1 and ``steps_per_generation`` 1; nothing reads the old
        log-probs before training (the estimators read them only for a KL penalty in the reward,
        ``kl_coef`` > 0); and no rollout engine's log-probs (``engine_logp``: vLLM's) are compared
        with them (TRL computes them with vLLM too)."""
        return (
            OLD_LOGP in self.passes
            and (settings.ppo_epochs, settings.mini_batches) == (1, 1)
            and settings.kl_coef == 0
            and not engine_logp
        )

    def fill(self, r: Rollout, outputs: Mapping[ModelStage, torch.Tensor], response_len: int) -> None:
        """The rollout's fields from the passes that ran (``outputs``); the rule's score is the reward
        unless a score pass (a reward model) ran."""
        r.score = r.rule_score
        for p in self.passes:
            if p.stage in outputs:
                p.fill(r, outputs[p.stage], response_len)

    def train_objectives(
        self,
        settings: PPOConfig,
        algorithm: GroupSettings,
        stages: Collection[ModelStage],
        *,
        old_logp_reused: bool = False,
    ) -> dict[ModelStage, Objective]:
        """The objective of each train model-stage among ``stages`` (the job's), in the entry's order;
        actor/train's on the current log-probs as the old ones when ``old_logp_reused``
        (``reuses_old_logp``)."""
        out = {s: of(settings, algorithm) for s, of in self.objectives.items() if s in stages}
        if old_logp_reused and ModelStage.ACTOR_TRAIN in out:
            out[ModelStage.ACTOR_TRAIN] = reusing_current_logp(out[ModelStage.ACTOR_TRAIN])
        return out


# name -> entry; AlgorithmConfig accepts exactly these names (a live view: an entry registered
# later is accepted too).
ALGORITHMS: dict[str, Algorithm] = {}


def register(entry: Algorithm) -> Algorithm:
    """Add ``entry`` under its name (a name already taken is an error); returns it."""
    if entry.name in ALGORITHMS:
        raise ValueError(f"algorithm {entry.name!r} is registered already; register it under another name")
    ALGORITHMS[entry.name] = entry
    return entry


def algorithm(name: str) -> Algorithm:
    """The entry called ``name``."""
    if name not in ALGORITHMS:
        raise KeyError(f"algorithm {name!r} is unknown; valid: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


PPO = register(
    Algorithm(
        name="ppo",
        passes=(SCORE, REF_LOGP, OLD_LOGP, VALUES),
        estimator=gae_advantages,
        objectives={ModelStage.ACTOR_TRAIN: ppo_actor, ModelStage.CRITIC_TRAIN: ppo_critic},
        always_reference=True,
    )
)
GRPO = register(
    Algorithm(
        name="grpo",
        passes=(REF_LOGP, OLD_LOGP),
        estimator=group_advantages,
        objectives={ModelStage.ACTOR_TRAIN: grpo_actor_objective},
        groups=True,
    )
)
