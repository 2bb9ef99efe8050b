"""nereus_core.plan: plan ids, placement, plan-level sums; and the `nereus plan` command that shows them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from nereus_core.config import ModelConfig, parse_config
from nereus_core.cost.plan_estimate import memory_per_device, step_seconds
from nereus_core.cost.stage_cost import MemoryEstimate
from nereus_core.layout import Layout
from nereus_core.plan import (
    MODEL_STAGES,
    PPO_STAGES,
    GlobalPlan,
    ModelStage,
    PlanRules,
    copies,
    default_plan,
    generation_apart,
    infer_placement,
    model_of,
    models_for,
    own_state,
    phases,
    plan_id,
    problems,
    slot_groups,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_ppo.yaml"


def colocated(tp: int = 1, dp: int = 2, m: int = 1) -> GlobalPlan:
    layout = Layout.contiguous(tp=tp, dp=dp, micro_batches=m)
    return GlobalPlan(placement="colocated", layouts=dict.fromkeys(MODEL_STAGES, layout))


def test_plan_id_is_stable_and_names_every_layout() -> None:
    a, b = colocated(), colocated()
    assert a.plan_id == b.plan_id and a == b and hash(a) == hash(b)
    assert a.plan_id.startswith("plan-") and len(a.plan_id) == 17
    assert colocated(m=2).plan_id != a.plan_id  # micro-batches are part of the plan
    assert colocated(tp=2, dp=1).plan_id != a.plan_id
    reordered = GlobalPlan(placement="colocated", layouts=dict(reversed(list(a.layouts.items()))))
    assert reordered.plan_id == a.plan_id
    again = GlobalPlan.model_validate_json(a.model_dump_json())
    assert again == a and again.plan_id == a.plan_id
    assert a.describe().startswith("colocated | actor/generate tp1.pp1.dp2 m1 @0..1 | actor/train")


def test_placement_from_the_config_plan() -> None:
    import yaml

    cfg = parse_config(yaml.safe_load(EXAMPLE.read_text()))
    plan = GlobalPlan.of(default_plan(cfg.plan, cfg.stages))
    # the example puts the reference on slot 0 only, the rest on slots 0 and 1
    assert plan.placement == "disaggregated" and plan.devices == (0, 1)
    # model-stages the config leaves out start on slot 0 as one replica
    assert default_plan({}, PPO_STAGES) == dict.fromkeys(MODEL_STAGES, Layout.contiguous())
    assert infer_placement(colocated().layouts) == "colocated"
    with pytest.raises(ValueError, match="at least one model-stage"):
        GlobalPlan(placement="colocated", layouts={})


def test_memory_per_device_sums_resident_state_and_takes_the_largest_transient() -> None:
    plan = GlobalPlan(
        placement="disaggregated",
        layouts={"actor/generate": Layout.contiguous(dp=2), "actor/train": Layout.contiguous(first=1)},
    )
    memory = {
        "actor/generate": MemoryEstimate(weights=10, kv_cache=7),
        "actor/train": MemoryEstimate(weights=10, optimizer=30, gradients=10, activations=5),
    }
    assert memory_per_device(plan, memory) == {0: 10 + 7, 1: 10 + 40 + max(7, 15)}


def _on(first: int, n: int) -> Layout:
    return Layout.contiguous(dp=n, first=first)


COLOCATED = {"actor/generate": _on(0, 4), "actor/train": _on(0, 4), "critic/train": _on(0, 4)}
APART = {"actor/generate": _on(0, 2), "actor/train": _on(2, 2), "critic/train": _on(2, 2)}


def test_step_time_by_placement() -> None:
    times = {"actor/generate": 5.0, "actor/train": 3.0, "critic/train": 1.0}
    assert step_seconds(COLOCATED, times, 0.5, overlap=True) == 9.5
    assert step_seconds(APART, times, 0.5, overlap=False) == 9.5
    assert step_seconds(APART, times, 0.5, overlap=True) == 5.5
    two = {s: APART[s] for s in ("actor/generate", "actor/train")}
    assert step_seconds(two, {"actor/generate": 1.0, "actor/train": 3.0}, 0.5, overlap=True) == 3.0


PHASED = {
    "actor/generate": _on(0, 4),
    "actor/train": _on(0, 2),
    "critic/infer": _on(0, 2),
    "critic/train": _on(2, 2),
    "reference/infer": _on(2, 1),
    "reward/infer": _on(3, 1),
}


def test_a_phase_takes_its_slowest_pool_and_a_pool_adds_its_stages() -> None:
    times = {
        "actor/generate": 5.0,
        "critic/infer": 1.0,
        "reference/infer": 2.0,
        "reward/infer": 0.5,
        "actor/train": 3.0,
        "critic/train": 4.0,
    }
    # generation 5 + sync 0.5, forward passes max(1, 2, 0.5), train stages max(3, 4)
    assert step_seconds(PHASED, times, 0.5, overlap=True) == 5.5 + 2.0 + 4.0
    shared = {**PHASED, "reward/infer": _on(2, 2)}  # shares slot 2 with the reference: one pool
    assert step_seconds(shared, times, 0.5, overlap=False) == 5.5 + 2.5 + 4.0


def test_phases_group_the_stages_that_share_slots() -> None:
    assert infer_placement(PHASED) == "phased"
    assert infer_placement(COLOCATED) == "colocated"
    assert infer_placement(APART) == "disaggregated"
    got = phases(PHASED)
    assert list(got) == ["generate", "infer", "train"]
    assert got["infer"] == (("critic/infer",), ("reference/infer",), ("reward/infer",))
    assert got["train"] == (("actor/train",), ("critic/train",))
    # the old log-probs run on actor/train's slots in the forward-pass phase: passes there wait for them
    spanning = {**PHASED, "actor/train": _on(0, 4)}
    assert phases(spanning)["infer"] == (("critic/infer", "reference/infer", "reward/infer"),)
    chained = {"a": _on(0, 2), "b": _on(3, 1), "c": _on(1, 3)}  # c joins a and b
    assert slot_groups(chained) == (("a", "b", "c"),)
    assert not generation_apart(PHASED) and generation_apart(APART)


def test_problems_name_what_cannot_run() -> None:
    models = models_for(ModelConfig())
    rules = PlanRules(models=models, devices=4, batch=8)
    bad = {"actor/train": Layout.contiguous(tp=3, dp=2)}
    assert any("tp=3 does not divide" in p for p in problems(bad, rules))
    assert any("not divisible by dp*micro_batches" in p for p in problems(bad, replace(rules, batch=9)))
    assert problems(colocated().layouts, rules) == []
    assert problems(colocated(dp=4).layouts, replace(rules, devices=2))  # slots beyond the pool
    # a train stage splits the batch into mini-batches: dp=4 divides 8 but not 8/4
    assert problems({"actor/generate": Layout.contiguous(dp=4)}, replace(rules, mini_batches=4)) == []
    split = problems({"actor/train": Layout.contiguous(dp=4)}, replace(rules, mini_batches=4))
    assert split == [
        "actor/train: job.batch_size/ppo.mini_batches=2 is not divisible by dp*micro_batches=4; "
        "choose a batch size that is a multiple of it"
    ]


def test_one_plan_id_for_the_same_layouts_whatever_the_placement_or_key_type() -> None:
    a = colocated()
    as_strings = {str(k): v for k, v in a.layouts.items()}
    assert plan_id(as_strings) == a.plan_id == GlobalPlan.of(as_strings).plan_id
    assert GlobalPlan(placement="disaggregated", layouts=a.layouts).plan_id == a.plan_id


def test_model_stage_knows_its_model_kind_and_state_owner() -> None:
    assert ModelStage("critic/infer").model == "critic" and ModelStage("critic/infer").kind == "infer"
    assert ModelStage.ACTOR_GENERATE.copy_of == ModelStage.ACTOR_TRAIN
    assert own_state(PPO_STAGES) == ("actor/train", "critic/train", "reference/infer", "reward/infer")
    assert {str(c): str(s) for c, s in copies(PPO_STAGES).items()} == {
        "actor/generate": "actor/train",
        "critic/infer": "critic/train",
    }
    with pytest.raises(ValueError):
        model_of("actor")


def test_models_for_gives_critic_and_reward_a_value_head_when_heads_exist() -> None:
    models = models_for(ModelConfig())
    if "head" in ModelConfig.model_fields:
        assert models["critic"].head == "value" and models["actor"].head == "lm"
    assert set(models) == {"actor", "critic", "reference", "reward"}


# ---------------------------------------------------------------------------- `nereus plan CONFIG`


def test_cli_plan_prints_the_chosen_plan_and_alternatives(capsys: pytest.CaptureFixture[str]) -> None:
    from flows.cli.main import main

    assert main(["plan", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "chosen plan-" in out and "step" in out
    for stage in MODEL_STAGES:
        assert stage in out
    assert "GiB" in out
    assert main(["plan", str(EXAMPLE), "--profile", "h100"]) == 0
    assert "h100-sxm" in capsys.readouterr().out


def test_cli_plan_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from flows.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {devices: 0}\n")
    assert main(["plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "cluster.devices" in err
    assert main(["plan", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
