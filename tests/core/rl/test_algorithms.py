"""nereus_core/rl/algorithms.py: the registry's entries say what each algorithm's step runs, and the
config asks them (one owner for the valid names and for the model-stages an algorithm needs)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from nereus_core.plan import ModelStage
from nereus_core.rl import algorithms
from nereus_core.rl.algorithm import AlgorithmConfig
from nereus_core.rl.ppo import PPOConfig
from nereus_core.rl.rollout import Rollout


def test_ppo_and_grpo_entries_name_their_passes_as_model_stages_in_the_order_they_run() -> None:
    ppo, grpo = algorithms.algorithm("ppo"), algorithms.algorithm("grpo")
    assert [p.stage for p in ppo.passes] == ["reward/infer", "reference/infer", "actor/train", "critic/infer"]
    assert [p.stage for p in grpo.passes] == ["reference/infer", "actor/train"]
    assert all(isinstance(p.stage, ModelStage) for p in (*ppo.passes, *grpo.passes))
    assert list(ppo.objectives) == ["actor/train", "critic/train"] and list(grpo.objectives) == [
        "actor/train"
    ]
    assert ppo.uses_critic and ppo.uses_reward_model and ppo.uses_reference(kl=False)
    assert not grpo.uses_critic and not grpo.uses_reward_model
    assert grpo.uses_reference(kl=True) and not grpo.uses_reference(kl=False)


def test_the_objectives_carry_their_statistic_keys() -> None:
    settings, grpo = PPOConfig(), AlgorithmConfig(name="grpo", group_size=4)
    ppo_objs = algorithms.PPO.train_objectives(settings, AlgorithmConfig(), list(ModelStage))
    assert ppo_objs[ModelStage.ACTOR_TRAIN].keys == algorithms.ACTOR_STATS
    assert ppo_objs[ModelStage.CRITIC_TRAIN].keys == algorithms.CRITIC_STATS
    assert not ppo_objs[ModelStage.CRITIC_TRAIN].with_entropy
    only_actor = algorithms.PPO.train_objectives(settings, AlgorithmConfig(), [ModelStage.ACTOR_TRAIN])
    assert list(only_actor) == [ModelStage.ACTOR_TRAIN]  # a stage the job lacks is left out
    actor = algorithms.GRPO.train_objectives(settings, grpo, list(ModelStage))[ModelStage.ACTOR_TRAIN]
    assert actor.keys == algorithms.GRPO_ACTOR_STATS and actor.group_size == 4


def test_fill_takes_the_rule_score_unless_a_score_pass_ran() -> None:
    r = Rollout(
        prompts=torch.zeros(2, 3, dtype=torch.long),
        responses=torch.zeros(2, 2, dtype=torch.long),
        mask=torch.ones(2, 2),
        rule_score=torch.tensor([0.25, 0.75]),
    )
    logp_full = torch.arange(8.0).view(2, 4)  # the lm head's [b, s-1]
    algorithms.GRPO.fill(r, {ModelStage.ACTOR_TRAIN: logp_full}, 2)
    assert r.score is r.rule_score and torch.equal(r.old_logp, logp_full[:, -2:]) and r.ref_logp is None
    values_full = torch.tensor([[0.0, 0, 0, 0, 3.0], [0, 0, 0, 0, 5.0]])  # the value head's [b, s]
    algorithms.PPO.fill(r, {ModelStage.REWARD_INFER: values_full}, 2)
    assert r.score.tolist() == [3.0, 5.0]  # the reward model's value after the last real token


def test_the_config_accepts_exactly_the_registered_names() -> None:
    with pytest.raises(ValidationError, match="'rloo_x' is unknown; valid: ppo, grpo"):
        AlgorithmConfig(name="rloo_x")
    entry = algorithms.Algorithm(
        name="rloo_x",
        passes=(algorithms.OLD_LOGP,),
        estimator=algorithms.group_advantages,
        objectives={ModelStage.ACTOR_TRAIN: algorithms.grpo_actor_objective},
        groups=True,
    )
    algorithms.register(entry)
    try:
        cfg = AlgorithmConfig(name="rloo_x", group_size=2)
        assert cfg.entry is entry and not cfg.uses_critic and not cfg.uses_reference(kl=True)
        with pytest.raises(ValidationError, match=r"rloo_x compares the responses .* at least 2"):
            AlgorithmConfig(name="rloo_x")
        with pytest.raises(ValueError, match="'rloo_x' is registered already"):
            algorithms.register(entry)
    finally:
        del algorithms.ALGORITHMS["rloo_x"]


def test_an_entry_must_train_the_actor_with_train_model_stages() -> None:
    with pytest.raises(ValueError, match="keyed by train model-stages and include actor/train"):
        algorithms.Algorithm(
            name="bad",
            passes=(),
            estimator=algorithms.gae_advantages,
            objectives={ModelStage.CRITIC_INFER: algorithms.ppo_critic},
        )
