"""nereus_core.gtg.execution: the units the transition executor runs are the GTG's ops, memory-safe.

The independent check replays the executed order op by op (every unit's allocations, then its
frees, one unit after another in each wave's order), the way the executor runs them, against the
capacities: it does not reuse the module's replay.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings

from nereus_core.gtg import build_gtg
from nereus_core.gtg.execution import NoStageSchedule, stage_schedule, unit_of
from tests.support.gtg_cases import REF, REW, SWAP_A, SWAP_B, SWAP_MODELS, loads, transitions


def run_serially(graph, schedule, initial: dict[int, int], caps: dict[int, int]) -> dict[int, int]:
    load = dict(initial)
    for wave in schedule.waves:
        for unit in wave:
            ops = [graph.op(i) for i in schedule.ops[unit]]
            for op in ops:
                if op.kind == "alloc":
                    load[op.device] = load.get(op.device, 0) + op.nbytes
                    assert load[op.device] <= caps[op.device], f"{unit}: device {op.device} over capacity"
            for op in ops:
                if op.kind == "free":
                    load[op.device] -= op.nbytes
    return load


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transitions())
def test_the_executed_units_cover_every_op_once_and_never_overflow(case: tuple) -> None:
    plan_a, plan_b, models, caps, slack = case
    graph = build_gtg(plan_a, plan_b, models, caps)
    try:
        schedule = stage_schedule(graph, caps)
    except NoStageSchedule:
        event("no unit schedule")
        assert slack < 1.0  # with room for old and new at once, whole units always fit
        return
    event(f"route {graph.route}, serial {schedule.serial}")
    executed = [i for wave in schedule.waves for unit in wave for i in schedule.ops[unit]]
    assert sorted(executed) == sorted(op.id for op in graph.ops if op.stage)
    assert len(set(schedule.order)) == len(schedule.order)
    end = run_serially(graph, schedule, loads(plan_a, models), caps)
    assert {d: b for d, b in end.items() if b} == {d: b for d, b in loads(plan_b, models).items() if b}
    wave_of = {u: k for k, wave in enumerate(schedule.waves) for u in wave}
    for e in graph.edges:  # data edges always point forward; memory ones too when it follows the GTG's order
        a, b = unit_of(graph, e.before), unit_of(graph, e.after)
        if a and b and a != b and (e.kind == "data" or (e.kind == "memory" and schedule.follows_gtg)):
            assert wave_of[a] < wave_of[b], (e, schedule.waves)


def test_a_swap_runs_the_unit_that_frees_room_first() -> None:
    caps = {0: REF + REW, 1: REF}  # device 1 holds one of the two models at a time
    graph = build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, caps)
    schedule = stage_schedule(graph, caps)
    assert schedule.order == ("move:reward/infer", "move:reference/infer")
    assert schedule.peak_bytes[1] <= REF


def test_a_durable_stage_unloads_before_the_live_one_loads_and_loads_after() -> None:
    caps = {0: REF, 1: REF}  # a wait cycle: the GTG sends reward/infer through the store
    graph = build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, caps)
    assert graph.route == "mixed"
    schedule = stage_schedule(graph, caps)
    order = schedule.order
    assert order.index("unload:reward/infer") < order.index("move:reference/infer")
    assert order.index("move:reference/infer") < order.index("load:reward/infer")
    run_serially(graph, schedule, loads(SWAP_A, SWAP_MODELS), caps)


def test_no_safe_order_of_whole_units_is_refused() -> None:
    caps = {0: REF + REW, 1: REF}
    graph = build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, caps)
    with pytest.raises(NoStageSchedule, match="overflows"):
        stage_schedule(graph, {0: REF + REW, 1: REW})  # tighter than the graph was built for
