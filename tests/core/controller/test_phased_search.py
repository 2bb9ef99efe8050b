"""Phased plans in the search: pool sizes by minimax, one step-time rule, memory where pools overlap."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_core.config import LLAMA_3_8B, Workload
from nereus_core.controller import phased_pools
from nereus_core.controller.decide import ControllerState, evaluate_plan
from nereus_core.controller.search import Searcher, SearchSpace
from nereus_core.cost.hardware import H100_SXM
from nereus_core.cost.plan_estimate import memory_per_device, step_seconds
from nereus_core.cost.stage_cost import MemoryEstimate, Scales
from nereus_core.layout import Layout
from nereus_core.plan import PPO_STAGES, GlobalPlan, PlanRules, models_for, phases, problems

GB = 1e9
OVERLAP = ControllerState.initial(
    models_for(LLAMA_3_8B), H100_SXM, stages=PPO_STAGES
).settings.overlap_disaggregated
WORK = Workload(batch=1024, prompt_len=512, response_mean=2000, response_high=6000, response_max=8000)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.floats(1, 100), min_size=5, max_size=5), min_size=2, max_size=3),
    st.integers(2, 40),
)
def test_the_phase_split_is_the_minimax_over_the_ladder(raw: list[list[float]], slots: int) -> None:
    sizes = [1, 2, 4, 8, 16]
    curves = {f"s{i}": np.minimum.accumulate(np.array(c)) for i, c in enumerate(raw)}  # faster on more slots
    got = phased_pools.split_phase(curves, sizes, slots)
    best = None
    for combo in itertools.product(range(len(sizes)), repeat=len(curves)):
        if sum(sizes[i] for i in combo) <= slots:
            worst = max(float(c[i]) for c, i in zip(curves.values(), combo, strict=True))
            best = worst if best is None else min(best, worst)
    if best is None:
        assert got is None
    else:
        assert got is not None and sum(got.values()) <= slots
        assert max(float(curves[s][sizes.index(v)]) for s, v in got.items()) == best


def test_fastest_by_size_keeps_only_what_fits_the_pool() -> None:
    world = np.array([4, 1, 2, 8])
    seconds = np.array([1.0, 9.0, 5.0, 0.5])
    assert phased_pools.fastest_by_size(world, seconds, [1, 2, 3, 4, 8]).tolist() == [9.0, 5.0, 5.0, 1.0, 0.5]
    assert np.isinf(phased_pools.fastest_by_size(world, seconds, [0])[0])


def test_pools_are_placed_largest_first_on_consecutive_slots() -> None:
    assert phased_pools.place({"a": 8, "b": 16, "c": 8}, 32) == {"b": 32, "a": 48, "c": 56}
    assert phased_pools.ladder(64, 8) == [1, 2, 4, 8, 16, 24, 32, 48, 64]


def test_memory_peak_is_the_per_slot_rule_of_plan_estimate() -> None:
    layouts = {"actor/generate": Layout.contiguous(dp=4), "actor/train": Layout.contiguous(dp=2, first=2)}
    memory = {
        "actor/generate": MemoryEstimate(weights=10, kv_cache=7),
        "actor/train": MemoryEstimate(weights=10, optimizer=30, gradients=20),
    }
    exact = max(memory_per_device(GlobalPlan.of(layouts), memory).values())
    intervals = [
        (v.devices[0], v.devices[-1] + 1, memory[s].persistent, memory[s].transient)
        for s, v in layouts.items()
    ]
    assert phased_pools.memory_peak(intervals) == exact == 10 + 40 + 20


def _search(devices: int, **space) -> list:
    found = Searcher(
        SearchSpace(devices=devices, budget=72 * GB, overlap=OVERLAP, **space),
        WORK,
        models_for(LLAMA_3_8B),
        H100_SXM,
        Scales(),
        stages=PPO_STAGES,
    ).run()
    return found.feasible


def test_at_scale_the_search_finds_phased_plans_that_run_and_beat_the_others() -> None:
    feasible = _search(1024)
    phased = [f for f in feasible if f.placement == "phased"]
    others = [f for f in feasible if f.placement != "phased"]
    assert phased and others
    state = ControllerState.initial(models_for(LLAMA_3_8B), H100_SXM, stages=PPO_STAGES)
    rules = PlanRules(models=models_for(LLAMA_3_8B), devices=1024, batch=WORK.batch)
    for f in phased:
        plan = f.plan
        assert problems(plan.layouts, rules) == []
        assert any(len(pools) > 1 for pools in phases(plan.layouts).values())
        exact = evaluate_plan(plan, WORK, state, int(72 * GB))
        assert exact.fits
        # the search's estimate is the plan estimate's (the same rule; the sync as the search folds it)
        assert abs(exact.step_s - f.seconds) <= 0.05 * exact.step_s
    # the search's best is phased and the exact estimate agrees it is faster than the best of the others
    best_other = min(evaluate_plan(f.plan, WORK, state, int(72 * GB)).step_s for f in others)
    best_phased = min(evaluate_plan(f.plan, WORK, state, int(72 * GB)).step_s for f in phased)
    assert best_phased < best_other
    # without phased splits the search offers none
    assert all(f.placement != "phased" for f in _search(1024, phased=False))


def test_a_phased_plan_s_step_is_the_rule_over_its_stage_estimates() -> None:
    state = ControllerState.initial(models_for(LLAMA_3_8B), H100_SXM, stages=PPO_STAGES)
    plan = next(f.plan for f in _search(64) if f.placement == "phased")
    exact = evaluate_plan(plan, WORK, state, int(72 * GB))
    stage_s = {s: e.seconds for s, e in exact.stages.items()}
    assert exact.step_s == step_seconds(plan.layouts, stage_s, exact.sync_s, overlap=OVERLAP)
    assert exact.step_s < sum(stage_s.values()) + exact.sync_s  # some stages run at once


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 2048), st.sampled_from([1, 4, 8]))
def test_the_phased_regions_of_n_slots_are_among_those_of_n_plus_one(n: int, per_node: int) -> None:
    fewer, more = phased_pools.regions(n, per_node), phased_pools.regions(n + 1, per_node)
    assert set(fewer) <= set(more)
    assert all(g + r <= n for g, r in fewer)
