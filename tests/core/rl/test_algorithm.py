"""The ``algorithm:`` section in the job config (nereus_core/rl/algorithm.py, nereus_core/config/job.py) and
the job's model-stages that follow from it (nereus_core/plan.py ``stages_for``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nereus_core.config import ConfigError, parse_config
from nereus_core.config.from_yaml import parse_yaml
from nereus_core.plan import MODEL_STAGES, PPO_STAGES, copies, default_plan, load_order, own_state, stages_for

ROOT = Path(__file__).resolve().parents[3]
GRPO = {"algorithm": {"name": "grpo", "group_size": 4}, "job": {"batch_size": 16}}


def grpo(**sections: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) for k, v in GRPO.items()}
    for name, fields in sections.items():
        out.setdefault(name, {}).update(fields)
    return out


def test_ppo_is_the_default_and_has_all_six_stages() -> None:
    cfg = parse_config({})
    assert cfg.algorithm.name == "ppo" and cfg.stages == PPO_STAGES == MODEL_STAGES
    # PPO keeps its reference even without a KL term (its step reports the KL to it)
    assert parse_config({"ppo": {"kl_coef": 0.0}}).stages == MODEL_STAGES


def test_grpo_stages_follow_its_kl_settings() -> None:
    with_penalty = parse_config(grpo())  # ppo.kl_coef defaults to 0.05: a KL term, so a reference
    assert with_penalty.stages == ("actor/generate", "actor/train", "reference/infer")
    no_kl = parse_config(grpo(ppo={"kl_coef": 0.0}))
    assert no_kl.stages == ("actor/generate", "actor/train")
    kl_loss = parse_config(grpo(ppo={"kl_coef": 0.0, "use_kl_loss": True, "kl_loss_coef": 0.01}))
    assert "reference/infer" in kl_loss.stages
    assert "critic/train" not in kl_loss.stages and "reward/infer" not in kl_loss.stages


def test_stage_helpers_answer_for_the_set_they_are_given() -> None:
    stages = stages_for(critic=False, reference=True, reward_model=False)
    assert own_state(stages) == ("actor/train", "reference/infer")
    assert copies(stages) == {"actor/generate": "actor/train"}
    assert load_order(stages) == ("actor/train", "reference/infer", "actor/generate")
    assert list(default_plan({}, stages)) == list(stages)
    assert len(own_state(PPO_STAGES)) == 4 and len(copies(PPO_STAGES)) == 2


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        (grpo(algorithm={"group_size": 1}), ("group_size must be at least 2",)),
        (grpo(job={"batch_size": 18}), ("job.batch_size=18 is not a multiple of algorithm.group_size=4",)),
        (
            grpo(job={"batch_size": 12}, ppo={"mini_batches": 2}),
            ("3 prompts do not split into ppo.mini_batches=2", "multiple of 8"),
        ),
        (
            grpo(plan={"critic/train": {"devices": [0]}}),
            ("plan.critic/train", "algorithm grpo", "has no critic/train", "remove it from plan"),
        ),
        (
            grpo(ppo={"kl_coef": 0.0}, plan={"reference/infer": {"devices": [0]}}),
            ("plan.reference/infer", "actor/generate, actor/train"),
        ),
        ({"algorithm": {"group_size": 4}}, ("algorithm.group_size=4 is read by grpo only",)),
        (grpo(algorithm={"kl_loss_coef": 0.1}), ("algorithm.kl_loss_coef: unknown field",)),
    ],
)
def test_inconsistent_algorithm_input_is_one_line(data: dict[str, Any], needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    line = str(err.value)
    assert "\n" not in line
    for needle in needles:
        assert needle in line, line


def test_a_grpo_plan_of_its_own_stages_is_accepted() -> None:
    cfg = parse_config(grpo(plan={"actor/train": {"devices": [0]}, "reference/infer": {"devices": [0]}}))
    assert set(default_plan(cfg.plan, cfg.stages)) == set(cfg.stages)


def test_the_grpo_example_loads_with_no_critic_and_no_reward_model() -> None:
    cfg = parse_config(parse_yaml((ROOT / "examples" / "tiny_grpo.yaml").read_text()))
    assert cfg.algorithm.name == "grpo" and cfg.stages == ("actor/generate", "actor/train")
    assert set(cfg.plan) == set(cfg.stages)
