"""nereus_core.sim world at 7-8B: the fit on published timings, decode's TP traffic, the world's own weight
sync, the oracle's phase rule, and the baselines built from their documented defaults."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from benchmarks import fit_world_7b as fw
from nereus_core.cost.hardware import H100_SXM
from nereus_core.cost.transition_cost import weight_sync_s
from nereus_core.layout import Layout
from nereus_core.plan import GENERATE, MODEL_STAGES, GlobalPlan, sync_colocated
from nereus_core.sim import stage_world as sw
from nereus_core.sim import transitions
from nereus_core.sim.baselines import INFER, TRAIN, OpenRLHFStrategy, VerlStrategy, _phase, job_slot_groups
from nereus_core.sim.config import NoiseSettings, StrategySpec, parse_sim_config
from nereus_core.sim.shapes import weight_tensors
from nereus_core.sim.trace import parse_trace
from nereus_core.sim.world import World

HEADER = "step,devices,capacity_gb,batch,prompt_len,response_mean,response_p90,response_max"


def small_world(steps: int = 3, devices: int = 16) -> tuple[World, object]:
    rows = [HEADER] + [f"{k},{devices},80,1024,100,600,1200,1800" for k in range(steps)]
    cfg = parse_sim_config({"traces": [{"name": "t", "file": "unused.csv"}]})
    tr = parse_trace("\n".join(rows) + "\n", name="t")
    return World(tr, cfg.model, H100_SXM, NoiseSettings(), 0), cfg


# ---------------------------------------------------------------- the fit on published 7B runs


def test_fit_is_the_stored_constants_and_holds_on_held_out_runs() -> None:
    rows = fw._v1() + fw._v2() + fw._v4() + fw._f1()
    fitted = fw.fit([r for r in rows if r.run in fw.FITTED_RUNS], sw.WorldConstants())
    stored = sw.FITTED_7B
    names = (
        "generate_fixed_s",
        "decode_step_s",
        "decode_step_graphs_s",
        "infer_fixed_s",
        "train_fixed_s",
        "mfu",
    )
    for name in names:
        assert getattr(fitted, name) == pytest.approx(getattr(stored, name), rel=0.01, abs=0.01), name
    # Every fitted generation within 1.3x, eager and CUDA graphs (verl's vLLM 0.7 note: 85 s -> 62 s).
    gens = [r for r in fw.report([r for r in rows if r.run in fw.FITTED_RUNS], stored) if "gen" in r["stage"]]
    assert len(gens) == 4 and all(1 / 1.3 <= r["ratio"] <= 1.3 for r in gens), gens
    assert stored.decode_step_graphs_s < 0.6 * stored.decode_step_s
    assert sw.constants_for(8.0e9) is stored and sw.constants_for(0.5e9) is sw.FITTED
    # Held out, tolerances stated: verl's FSDP2 run (not fitted) generates within 20 %.
    gen = [r for r in fw.report(fw._f1(), stored) if r["stage"].startswith("gen")]
    assert all(0.8 <= r["ratio"] <= 1.2 for r in gen), gen
    # V1's passes alone predict V2's (another model, TP4 PP2, GRPO) within 55 %.
    v1 = fw.fit([r for r in rows if r.run == "V1"], stored, generation=False)
    v2 = fw.report([r for r in rows if r.run == "V2" and r.kind != "generate"], v1)
    assert all(0.65 <= r["ratio"] <= 1.55 for r in v2), v2
    # OpenRLHF's 8 x A800 benchmark: mean length unpublished; its generation lies inside the world's
    # range for means of 512-1,024 tokens and its training within 15 % of that range.
    o1 = fw.openrlhf_check(stored)
    lo, hi = o1["mean_response_512"], o1["mean_response_1024"]
    assert lo["generation_s"] <= o1["published"]["generation_s"] <= hi["generation_s"]
    assert 0.85 * lo["training_s"] <= o1["published"]["training_s"] <= 1.15 * hi["training_s"]


def test_7b_world_passes_are_flop_bound_not_fixed_cost_bound() -> None:
    c, size = sw.FITTED_7B, fw.QWEN2_7B
    stats = sw.StepStats(1024, 200.0, 2000.0, 8000)
    one = sw.stage_s("train", stats, size, sw.H100_80GB, c, tp=1, dp=8)
    two = sw.stage_s("train", stats, size, sw.H100_80GB, c, tp=1, dp=16)
    assert two < 0.6 * one  # twice the replicas nearly halves a long-response train stage


# ---------------------------------------------------------------- decode's TP all-reduce traffic


def test_decode_time_grows_with_tp_all_reduce_bytes() -> None:
    c, stats = sw.FITTED_7B, sw.StepStats(256, 100.0, 500.0, 1000)
    lengths = sw.draw_lengths(stats, np.random.default_rng(0), c.length_concentration)
    fast, slow = sw.H100_80GB, replace(sw.H100_80GB, link_bytes_per_s=38e9)
    narrow = replace(fw.QWEN2_7B, hidden=1024)
    tp4 = sw.Shape(tp=4)

    def gen(gpu: sw.Gpu, size: sw.ModelSize, shape: sw.Shape) -> float:
        return sw.generation_s(lengths, 100.0, size, gpu, c, shape)

    assert gen(slow, fw.QWEN2_7B, tp4) > gen(fast, fw.QWEN2_7B, tp4)  # the same bytes over a slower link
    assert gen(slow, fw.QWEN2_7B, tp4) > gen(slow, narrow, tp4)  # more bytes per token
    assert gen(slow, fw.QWEN2_7B, sw.Shape(tp=1)) == gen(fast, fw.QWEN2_7B, sw.Shape(tp=1))  # none at TP1
    tokens, ring = float(lengths.sum()), 2.0 * 3 / 4
    wire = tokens * fw.QWEN2_7B.layers * 2 * fw.QWEN2_7B.hidden * 2.0 * ring
    extra = gen(slow, fw.QWEN2_7B, tp4) - gen(fast, fw.QWEN2_7B, tp4)
    assert extra == pytest.approx(wire / 38e9 - wire / 380e9, rel=1e-6)


# ---------------------------------------------------------------- the world's weight sync


def cost_sync_s(world: World, plan: GlobalPlan) -> float:
    """The cost model's estimate of ``plan``'s weight sync."""
    train, gen = plan.layouts["actor/train"], plan.layouts[GENERATE]
    colocated = sync_colocated(train, gen)
    return weight_sync_s(train, gen, world.models["actor"], H100_SXM, colocated=colocated)


def test_world_sync_is_its_own_formula_not_the_cost_models() -> None:
    world, _ = small_world()
    weights = 2.0 * world.sizes["actor"].params

    def plan(train: Layout, gen: Layout) -> GlobalPlan:
        return GlobalPlan.model_construct(
            placement="disaggregated", layouts={"actor/train": train, GENERATE: gen}
        )

    near = [plan(Layout.contiguous(dp=4), Layout.contiguous(tp=tp, dp=4 // tp, first=4)) for tp in (1, 4)]
    for p in near:  # inside one node: the weights once over NVLink (or the floor), whatever the engine's TP
        want = max(transitions.SYNC_FLOOR_NCCL_S, weights / transitions.NVLINK_BYTES_PER_S)
        assert world.true_sync_s(p) == pytest.approx(want)
    raw = [cost_sync_s(world, p) for p in near]
    assert raw[0] != pytest.approx(raw[1])  # the cost model's sync depends on the engine's TP: they disagree
    far = plan(Layout.contiguous(dp=8), Layout.contiguous(tp=2, dp=4, first=8))  # across nodes: InfiniBand
    want = max(transitions.SYNC_FLOOR_NCCL_S, weights / transitions.IB_BYTES_PER_S)
    assert world.true_sync_s(far) == pytest.approx(want)
    assert world.true_sync_s(far) != pytest.approx(cost_sync_s(world, far))


def test_per_tensor_broadcast_prices_every_tensor() -> None:
    world, cfg = small_world()
    plan = GlobalPlan.model_construct(
        placement="disaggregated",
        layouts={"actor/train": Layout.contiguous(dp=8), GENERATE: Layout.contiguous(dp=8, first=8)},
    )
    bucketed = world.true_sync_s(plan)
    world.per_tensor_sync = True
    tensors = weight_tensors(cfg.model)
    assert tensors == 32 * 9 + 3  # Llama-3-8B: 291 tensors
    assert world.true_sync_s(plan) == pytest.approx(
        2.0 * world.sizes["actor"].params / transitions.IB_BYTES_PER_S + tensors * transitions.PER_TENSOR_S
    )
    assert world.true_sync_s(plan) > 10 * bucketed
    colocated = GlobalPlan.model_construct(
        placement="colocated",
        layouts={"actor/train": Layout.contiguous(dp=16), GENERATE: Layout.contiguous(tp=2, dp=8)},
    )
    assert world.true_sync_s(colocated) == pytest.approx(transitions.SYNC_FLOOR_COLOCATED_S, rel=0.05)


# ---------------------------------------------------------------- baselines


def test_openrlhf_oracle_phases_agree_with_the_step_rule() -> None:
    world, cfg = small_world()
    pools = job_slot_groups("separate", world.stages)
    sizes = {"G": 4, "A": 4, "C": 4, "R": 2, "W": 2}
    plan = OpenRLHFStrategy("o", spec=StrategySpec(kind="openrlhf"), settings=cfg.controller)._assemble(
        world, pools, sizes, 2, 1, 1024
    )
    rng = np.random.default_rng(3)
    per_stage = {s: rng.uniform(1, 10, size=5) for s in MODEL_STAGES}
    others = [p for p in pools if p != "G"]
    oracle = (
        per_stage[GENERATE]
        + _phase(per_stage, pools, INFER, others)
        + _phase(per_stage, pools, TRAIN, others)
    )
    for k in range(5):
        rule = world.step_s(plan, {s: float(v[k]) for s, v in per_stage.items()}, 0.0)
        assert oracle[k] == pytest.approx(rule)


def test_default_baselines_are_built_as_documented() -> None:
    world, cfg = small_world()
    verl = VerlStrategy(
        "v", spec=StrategySpec(kind="verl", config="default", tune_steps=2), settings=cfg.controller
    )
    plan = verl.begin(world).plan
    gen = plan.layouts[GENERATE]
    assert plan.placement == "colocated" and (gen.tp, gen.pp, gen.dp) == (2, 1, 8)  # ppo_trainer.yaml: TP2
    assert all(set(v.devices) == set(range(16)) for v in plan.layouts.values())  # one pool, every stage
    assert len({(v.tp, v.pp) for s, v in plan.layouts.items() if s != GENERATE}) == 1
    assert world.sharded_weights  # FSDP full shard
    world2, _ = small_world()
    spec = StrategySpec(kind="openrlhf", config="default", tune_steps=2)
    plan2 = OpenRLHFStrategy("o", spec=spec, settings=cfg.controller).begin(world2).plan
    gen2 = plan2.layouts[GENERATE]
    assert plan2.placement == "colocated" and (gen2.tp, gen2.dp) == (2, 8)  # README: colocate_all, TP2
    assert all(v.pp == 1 for v in plan2.layouts.values()) and world2.per_tensor_sync
    assert world2.sharded_weights  # ZeRO-3
    paper = parse_sim_config(
        {
            "traces": [{"name": "t", "file": "x.csv"}],
            "strategies": {"d": {"kind": "verl", "config": "default"}},
        }
    )
    assert paper.strategies["d"].config == "default"


def test_pass_replicas_hold_balanced_tokens() -> None:
    """A pass's batch is dealt to its replicas by length (verl's balance_batch, Nereus's dispatch): at
    dp 64 on ORZ's last step the fullest replica holds within 1 % of the mean, where a contiguous
    split of the drawn lengths puts 14 % more on it."""
    stats = sw.StepStats(8192, 84.0, 2555.0, 8534, response_p90=4998.0)
    lengths = sw.draw_lengths(stats, np.random.default_rng(0), sw.FITTED_7B.length_concentration)
    dealt = sw.balanced_replicas(lengths, 64)
    assert dealt.shape == (64, 128) and sorted(dealt.ravel().tolist()) == sorted(lengths.tolist())
    tokens = (84.0 + dealt).sum(axis=1)
    assert tokens.max() / tokens.mean() < 1.01
    contiguous = (84.0 + lengths.reshape(64, -1)).sum(axis=1)
    assert contiguous.max() / contiguous.mean() > 1.1


# ---------------------------------------------------------------- the floor no plan can beat


def test_the_floor_is_below_every_layout_s_truth_phase_by_phase() -> None:
    world, _ = small_world(devices=16)
    world.begin_step(1)
    work = world.trace.workloads[1]
    floor = world.floor_s(1)
    c, lengths = world.constants, world.lengths(1)
    assert floor["generate"] == pytest.approx(c.generate_fixed_s + c.decode_step_s * lengths.max())
    degrees = [(tp, pp, 16 // (tp * pp)) for tp in (1, 2, 4, 8) for pp in (1, 2, 4) if tp * pp <= 16]
    by_kind: dict[str, list[float]] = {"generate": [], "infer": [], "train": []}
    for tp, pp, dp in degrees:
        for m in (1, 2, 4):
            layout = Layout.contiguous(tp=tp, pp=pp, dp=dp, micro_batches=m)
            for kind, stages in (("generate", [GENERATE]), ("infer", INFER), ("train", TRAIN)):
                # The stages of a pass phase one after another on all 16 devices (colocated), and the
                # slowest of them alone on a quarter of the devices (a phased pool).
                if kind == "generate":
                    by_kind[kind].append(world.truth_s(GENERATE, layout, work))
                    continue
                by_kind[kind].append(sum(world.truth_s(s, layout, work) for s in stages))
                if dp % 4 == 0:
                    quarter = Layout.contiguous(tp=tp, pp=pp, dp=dp // 4, micro_batches=m)
                    by_kind[kind].append(max(world.truth_s(s, quarter, work) for s in stages))
    for kind, seconds in by_kind.items():
        # Below every one, and within reach of the best (the floor is not vacuous).
        assert floor[kind] <= min(seconds), (kind, floor[kind], min(seconds))
        assert min(seconds) <= 1.5 * floor[kind], (kind, floor[kind], min(seconds))
