"""nereus_core.sim with a GRPO job: the job's model-stages come from ``stages_for``; every strategy plans
only those; PPO runs as before; the critic's and the reward model's time is gone from GRPO's steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from nereus_core.config import ConfigError
from nereus_core.cost.hardware import H100_SXM
from nereus_core.layout import Layout
from nereus_core.plan import GENERATE, MODEL_STAGES, PPO_STAGES, GlobalPlan, ModelStage, stages_for
from nereus_core.sim.baselines import job_slot_groups
from nereus_core.sim.config import parse_sim_config
from nereus_core.sim.job import SimJob, make_strategy, run_job
from nereus_core.sim.loop import simulate, stage_column
from nereus_core.sim.strategies import FixedStrategy
from nereus_core.sim.trace import parse_trace
from nereus_core.sim.world import World

ROOT = Path(__file__).resolve().parents[3]
HEADER = "step,devices,capacity_gb,batch,prompt_len,response_mean,response_p90,response_max"
GRPO = {"name": "grpo", "group_size": 8}
STRATEGIES = {
    "nereus": {"kind": "nereus"},
    "static": {"kind": "static"},
    "openrlhf": {"kind": "openrlhf", "tune_steps": 3},
    "openrlhf-separate": {"kind": "openrlhf", "placements": ["separate"], "tune_steps": 3},
    "verl": {"kind": "verl", "tune_steps": 3},
}


def trace(steps: int = 6, batch: int = 1024, grow_at: int = 3):
    """16 devices, 32 from step ``grow_at`` (a forced move for every strategy that moves), growing lengths."""
    rows = [HEADER]
    for k in range(steps):
        m = 600.0 + 40 * k
        rows.append(
            f"{k},{16 if k < grow_at else 32},80.0,{batch},100,{m},{math.ceil(2 * m)},{math.ceil(3 * m)}"
        )
    return parse_trace("\n".join(rows) + "\n", name="t")


def config(**overrides):
    return parse_sim_config({"traces": [{"name": "t", "file": "x"}], "strategies": STRATEGIES, **overrides})


def plan_stages(description: str) -> set[str]:
    """The model-stages of a plan from its one-line description (``GlobalPlan.describe``)."""
    return {part.split()[0] for part in description.split(" | ")[1:]}


def test_the_jobs_stages_come_from_stages_for() -> None:
    assert config().stages == PPO_STAGES == config(kl=False).stages  # PPO runs its reference anyway
    grpo = config(algorithm=GRPO)
    assert grpo.stages == stages_for(critic=False, reference=True, reward_model=False)
    assert config(algorithm=GRPO, kl=False).stages == (ModelStage.ACTOR_GENERATE, ModelStage.ACTOR_TRAIN)
    with pytest.raises(ConfigError, match=r"^algorithm: grpo compares .* group_size must be at least 2"):
        config(algorithm={"name": "grpo"})


@pytest.mark.parametrize("kl", [True, False])
def test_every_strategy_runs_grpo_with_only_the_jobs_stages(kl: bool) -> None:
    cfg, tr = config(algorithm=GRPO, kl=kl), trace()
    stages = {str(s) for s in cfg.stages}
    absent = {str(s) for s in MODEL_STAGES} - stages
    assert {"critic/infer", "critic/train", "reward/infer"} <= absent
    for name in cfg.strategies:
        result = run_job(SimJob(cfg, tr, name, 0))
        assert result.plans and all(plan_stages(d) == stages for d in result.plans.values()), name
        assert len(result.records) == tr.steps and result.summary["throughput_tokens_per_s"] > 0
        for record in result.records:
            assert all(record[stage_column(s)] > 0 for s in stages), name
            assert not any(stage_column(s) in record for s in absent), name
        assert result.summary["transitions"] >= 1, name  # the devices change at step 3


def test_openrlhf_drops_the_critics_pool_and_keeps_the_rest() -> None:
    grpo = config(algorithm=GRPO).stages
    assert job_slot_groups("paired", grpo) == {"G": (GENERATE,), "A": ("actor/train", "reference/infer")}
    assert job_slot_groups("separate", grpo) == {
        "G": (GENERATE,),
        "A": ("actor/train",),
        "R": ("reference/infer",),
    }
    assert set(job_slot_groups("separate", PPO_STAGES)) == {"G", "A", "C", "R", "W"}
    cfg, tr = config(algorithm=GRPO), trace(3, grow_at=3)
    world = World(tr, cfg.model, H100_SXM, cfg.noise, 0, stages=cfg.stages)
    plan = make_strategy(cfg, "openrlhf-separate").begin(world).plan
    assert plan.placement == "disaggregated" and set(plan.layouts) == set(cfg.stages)
    slots = [set(v.devices) for v in plan.layouts.values()]
    assert all(a.isdisjoint(b) for i, a in enumerate(slots) for b in slots[i + 1 :])  # each its own GPUs


def test_the_ppo_path_is_the_default_and_an_explicit_ppo_config_runs_the_same() -> None:
    tr = trace(4)
    default, explicit = config(), config(algorithm={"name": "ppo"}, kl=False)
    for name in ("nereus", "static", "verl"):
        a, b = run_job(SimJob(default, tr, name, 0)), run_job(SimJob(explicit, tr, name, 0))
        assert a.summary == b.summary and a.plans == b.plans, name
        assert all(plan_stages(d) == {str(s) for s in PPO_STAGES} for d in a.plans.values()), name


class Pinned(FixedStrategy):
    """One plan for the whole run (micro-batches re-picked each step in truth, as every fixed strategy)."""

    def __init__(self, plan: GlobalPlan) -> None:
        super().__init__("pinned", headroom=0.1)
        self.plan = plan

    def initial_plan(self, world: World) -> GlobalPlan:
        return self.plan


def test_grpo_steps_lose_the_critics_and_reward_models_time_on_the_same_trace() -> None:
    tr = trace(4, grow_at=4)
    ppo, grpo = config(), config(algorithm=GRPO)
    layout = Layout.contiguous(tp=2, dp=8)
    layouts = {s: layout for s in PPO_STAGES} | {GENERATE: Layout.contiguous(tp=4, dp=4)}

    def run(cfg):
        world = World(tr, cfg.model, H100_SXM, cfg.noise, 0, stages=cfg.stages)
        plan = GlobalPlan.of({s: layouts[s] for s in cfg.stages})
        records, _ = simulate(world, Pinned(plan), trace="t", seed=0)
        return records

    for p, g in zip(run(ppo), run(grpo), strict=True):
        assert p["fits"] and g["fits"]
        gone = sum(p[stage_column(s)] for s in ("critic/infer", "critic/train", "reward/infer"))
        assert gone > 0
        # colocated: a step is its stages one after another; the actor's stages have at least as much
        # room for micro-batches without the critic beside them, so they take no longer
        assert p["stages_s"] - g["stages_s"] >= gone * (1 - 1e-9)
    # every strategy's GRPO steps are faster than its PPO steps on the same trace and seed (their stages:
    # a peer's launch flags may run out of memory in one run and not the other, and it then restarts)
    for name in ("nereus", "static", "openrlhf", "verl"):
        p_run, g_run = run_job(SimJob(ppo, tr, name, 0)), run_job(SimJob(grpo, tr, name, 0))
        assert sum(r["stages_s"] for r in g_run.records) < sum(r["stages_s"] for r in p_run.records), name


def test_the_grpo_example_simulates_grpo_with_every_strategy() -> None:
    data = yaml.safe_load((ROOT / "examples" / "paper_sim_grpo.yaml").read_text())
    cfg = parse_sim_config(data)
    assert cfg.algorithm.name == "grpo"
    assert cfg.stages == stages_for(critic=False, reference=True, reward_model=False)
    used = {s for t in cfg.traces for s in cfg.strategies_for(t)}
    assert used == set(cfg.strategies)
    assert {s.kind for s in cfg.strategies.values()} == {"nereus", "static", "openrlhf", "verl"}
