"""The Global Transition Graph (nereus_core/gtg): memory safety, coverage, routes and timing."""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from dataclasses import replace
from functools import cache

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nereus_core.config import ModelConfig
from nereus_core.emu import shard_map
from nereus_core.gtg import (
    Edge,
    LinkModel,
    Op,
    ScheduleInvalid,
    TransitionGraph,
    TransitionInfeasible,
    build_gtg,
    write_assignment,
)
from nereus_core.layout import Layout
from nereus_core.model.weights import param_shapes
from tests.support.gtg_cases import (
    LM,
    ON0,
    ON1,
    REF,
    REW,
    SWAP_A,
    SWAP_B,
    SWAP_MODELS,
    loads,
    shard,
    transitions,
)


def topological(
    g: TransitionGraph, rng: random.Random | None = None, kinds: tuple[str, ...] = ()
) -> list[str]:
    """Kahn's algorithm over the graph's edges (of ``kinds``, default all), ties broken by ``rng``;
    fails on a cycle."""
    indeg = {op.id: 0 for op in g.ops}
    succ: dict[str, list[str]] = defaultdict(list)
    for e in g.edges:
        if not kinds or e.kind in kinds:
            indeg[e.after] += 1
            succ[e.before].append(e.after)
    ready = [x for x, n in indeg.items() if n == 0]
    order = []
    while ready:
        x = ready.pop(rng.randrange(len(ready)) if rng else -1)
        order.append(x)
        for y in succ[x]:
            indeg[y] -= 1
            if indeg[y] == 0:
                ready.append(y)
    assert len(order) == len(g.ops), "the graph has a cycle"
    return order


def live_possible(
    plan_a: dict[str, Layout],
    plan_b: dict[str, Layout],
    models: dict[str, tuple[ModelConfig, bool]],
    caps: dict[int, int],
) -> bool:
    """Oracle for tiny problems: try every order of allocations (frees as early as their model-stage's
    new shards are all allocated)."""
    base: dict[int, int] = defaultdict(int)
    old: dict[tuple[str, int], int] = {}
    new: dict[tuple[str, int], int] = {}
    needs: dict[tuple[str, int], set[tuple[str, int]]] = {}
    for s, (config, train) in models.items():
        if plan_a[s] == plan_b[s]:
            for d, b in shard(config, train, plan_a[s]).items():
                base[d] += b
            continue
        old.update({(s, d): b for d, b in shard(config, train, plan_a[s]).items()})
        new.update({(s, d): b for d, b in shard(config, train, plan_b[s]).items()})
        # Copy, then free: an old shard goes once all of its model-stage's new shards are there.
        needs.update({(s, d): {(s, n) for n in plan_b[s].devices} for d in plan_a[s].devices})
    cap = {d: caps.get(d, 0) for d in set(base) | {d for _, d in old} | {d for _, d in new}}
    cap.update({d: max(cap[d], base.get(d, 0) + sum(b for (_, x), b in old.items() if x == d)) for d in cap})

    @cache
    def ok(done: frozenset[tuple[str, int]]) -> bool:
        if len(done) == len(new):
            return True
        load = dict(base)
        for key, b in old.items():
            if not needs[key] <= done:
                load[key[1]] = load.get(key[1], 0) + b
        for key in done:
            load[key[1]] = load.get(key[1], 0) + new[key]
        return any(ok(done | {a}) for a in new if a not in done and load.get(a[1], 0) + new[a] <= cap[a[1]])

    return ok(frozenset())


def check(g: TransitionGraph, caps: dict[int, int], plan_a: dict[str, Layout], models: dict) -> None:
    """Everything a schedule must satisfy, asserted both by ``validate`` and directly."""
    g.validate(caps)
    topological(g)
    initial = loads(plan_a, models)
    for d, peak in g.peak_bytes.items():
        assert peak <= max(caps.get(d, 0), initial.get(d, 0)), f"device {d}: peak {peak} > {caps.get(d)}"
    json.dumps(g.to_dict())
    assert all(Op.from_dict(op.to_dict()) == op for op in g.ops[:50])


# -- hypothesis: random plan pairs and capacities ---------------------------------------------------


def assert_any_order_fits(
    g: TransitionGraph, caps: dict[int, int], initial: dict[int, int], rng: random.Random
) -> None:
    """The data and memory edges alone keep every device within capacity, whatever order an executor
    picks among ready ops (port edges only fix timing)."""
    load = dict(initial)
    for x in topological(g, rng, kinds=("data", "memory")):
        op = g.op(x)
        if op.kind == "alloc":
            load[op.device] = load.get(op.device, 0) + op.nbytes
            assert load[op.device] <= caps[op.device], f"{x}: {load[op.device]} B > {caps[op.device]} B"
        elif op.kind == "free":
            load[op.device] -= op.nbytes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transitions(), st.randoms(use_true_random=False))
def test_schedule_is_memory_safe_acyclic_and_covers_every_byte(case: tuple, rng: random.Random) -> None:
    plan_a, plan_b, models, caps, slack = case
    g = build_gtg(plan_a, plan_b, models, caps)
    event(f"route {g.route}")
    check(g, caps, plan_a, models)
    for _ in range(3):
        assert_any_order_fits(g, caps, loads(plan_a, models), rng)
    changed = {s for s in models if plan_a[s] != plan_b[s]}
    assert {op.stage for op in g.ops if op.stage} == changed
    if slack == 1.0:
        assert g.route == "live", g.reason  # room for old and new at once: live always fits
    if g.route != "live":
        assert g.reason.startswith(("durable:", "mixed:")) and "no live order" in g.reason


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transitions(max_devices=4, max_stages=2))
def test_route_is_live_exactly_when_some_live_order_exists(case: tuple) -> None:
    plan_a, plan_b, models, caps, _ = case
    allocs = sum(len(plan_b[s].devices) for s in models if plan_a[s] != plan_b[s])
    g = build_gtg(plan_a, plan_b, models, caps, search_budget=2**allocs)  # enough to be exhaustive
    event(f"route {g.route}")
    check(g, caps, plan_a, models)
    assert (g.route == "live") == live_possible(plan_a, plan_b, models, caps), g.reason


# -- hand-made cases ---------------------------------------------------------------------------------


def test_swap_fits_only_when_the_small_shard_leaves_first() -> None:
    assert REF > REW
    caps = {0: REF + REW, 1: REF}  # device 1 holds one of them at a time
    g = build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, caps)
    check(g, caps, SWAP_A, SWAP_MODELS)
    assert g.route == "live" and g.durable_stages == ()
    edge = ("free:reward/infer:1", "alloc:reference/infer:1", "memory")
    assert edge in [e.to_list() and (e.before, e.after, e.kind) for e in g.edges]
    wave = {x: i for i, w in enumerate(g.waves) for x in w}
    assert wave["free:reward/infer:1"] < wave["alloc:reference/infer:1"]
    assert g.peak_bytes == {0: REF + REW, 1: REF}


def test_swap_without_spare_room_sends_the_cheaper_stage_durable() -> None:
    caps = {0: REF, 1: REF}  # a wait cycle: each alloc needs the other device's free first
    g = build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, caps)
    check(g, caps, SWAP_A, SWAP_MODELS)
    assert g.route == "mixed" and g.durable_stages == ("reward/infer",)
    assert "wait cycle" in g.reason
    kinds = {op.id: op.kind for op in g.ops}
    assert kinds["snapshot:reward/infer:1"] == "snapshot" and kinds["rehydrate:reward/infer:0"] == "rehydrate"
    assert any(op.kind == "transfer" and op.stage == "reference/infer" for op in g.ops)


def test_own_old_and_new_shards_colliding_forces_the_durable_route() -> None:
    models = {"reference/infer": (LM, False)}
    plan_a = {"reference/infer": ON0}
    plan_b = {"reference/infer": Layout.contiguous(tp=2)}  # device 0 keeps half, device 1 gets half
    new = shard(LM, False, plan_b["reference/infer"])
    caps = {0: REF, 1: new[1]}
    g = build_gtg(plan_a, plan_b, models, caps)
    check(g, caps, plan_a, models)
    assert g.route == "durable" and "device 0 must hold reference/infer's old and new shards" in g.reason
    assert g.peak_bytes == {0: max(REF, new[0]), 1: new[1]}  # max(old, new) per device
    assert g.critical_link_bytes == {} or set(g.critical_link_bytes) <= {"0->store", "store->0", "store->1"}
    assert not any(op.kind in ("transfer", "copy") for op in g.ops)
    generous = build_gtg(plan_a, plan_b, models, {0: REF + new[0], 1: new[1]})
    assert generous.route == "live"


def test_allow_live_false_takes_the_durable_route() -> None:
    caps = {0: 10 * REF, 1: 10 * REF}
    g = build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, caps, allow_live=False)
    check(g, caps, SWAP_A, SWAP_MODELS)
    assert g.route == "durable" and "allow_live=False" in g.reason
    assert g.durable_stages == ("reference/infer", "reward/infer")


def test_plan_b_too_big_for_a_device_raises_naming_it() -> None:
    caps = {0: REF, 1: REW}  # plan B puts the reference model (REF bytes) on device 1
    with pytest.raises(TransitionInfeasible, match=rf"device 1 \(capacity {REW} B\).*needs {REF} B"):
        build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, caps)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="has no capacity"):
        build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, {0: 10 * REF})
    with pytest.raises(ValueError, match="same model-stages"):
        build_gtg(SWAP_A, {"reference/infer": ON1}, SWAP_MODELS, {0: REF, 1: REF})


def test_unchanged_layouts_produce_no_ops_and_removed_devices_end_empty() -> None:
    same = {"reference/infer": ON0, "reward/infer": ON1.model_copy(update={"micro_batches": 4})}
    g = build_gtg(SWAP_A, same, SWAP_MODELS, {0: REF, 1: REW})
    assert g.ops == () and g.route == "live" and g.critical_path_s == 0.0
    # Device 2 leaves: the reference model moves from it to device 0 (a new device in no plan A).
    plan_a = {"reference/infer": Layout.contiguous(first=2), "reward/infer": ON1}
    plan_b = {"reference/infer": ON0, "reward/infer": ON1}
    g = build_gtg(plan_a, plan_b, SWAP_MODELS, {0: REF, 1: REW})  # no capacity needed for device 2
    check(g, {0: REF, 1: REW}, plan_a, SWAP_MODELS)
    assert {op.stage for op in g.ops if op.stage} == {"reference/infer"}
    assert "free:reference/infer:2" in {op.id for op in g.ops}


def test_critical_path_of_a_single_move_by_hand() -> None:
    link = LinkModel(
        intra_node_bandwidth=1000.0, op_overhead_s=0.5, shard_op_s=0.25, regroup_s=2.0, commit_s=1.0
    )
    models = {"reference/infer": (LM, False)}
    plan_a, plan_b = {"reference/infer": ON0}, {"reference/infer": ON1}
    g = build_gtg(plan_a, plan_b, models, {0: REF, 1: REF}, link=link)
    tensors = len(param_shapes(LM))
    total = sum(math.prod(s) for s in param_shapes(LM).values()) * 4
    # regroup (2 s, longer than the alloc) -> every tensor in turn over 0->1 -> free -> commit.
    expected = 2.0 + tensors * 0.5 + total / 1000.0 + 0.25 + 1.0
    assert g.critical_path_s == pytest.approx(expected)
    assert g.waves_s == pytest.approx(expected)
    assert g.critical_link_bytes == {"0->1": total} and g.bytes_moved == total == g.link_bytes
    assert g.critical_path[0] == "regroup" and g.critical_path[-2:] == ("free:reference/infer:0", "commit")
    # Across nodes the inter-node bandwidth applies.
    far = build_gtg(
        plan_a, plan_b, models, {0: REF, 1: REF}, link=link.model_copy(update={"devices_per_node": 1})
    )
    assert far.critical_path_s == pytest.approx(expected - total / 1000.0 + total / link.inter_node_bandwidth)


def test_transfers_sharing_a_device_queue_and_disjoint_ones_overlap() -> None:
    link = LinkModel(
        intra_node_bandwidth=1000.0, op_overhead_s=0.0, shard_op_s=0.0, regroup_s=0.0, commit_s=0.0
    )
    models = {"reference/infer": (LM, False), "actor/generate": (LM, False)}
    total = REF / 1000.0
    shared = build_gtg(
        {"reference/infer": ON0, "actor/generate": ON0},
        {"reference/infer": ON1, "actor/generate": Layout.contiguous(first=2)},
        models,
        {0: 2 * REF, 1: REF, 2: REF},
        link=link,
    )
    assert shared.critical_path_s == pytest.approx(2 * total)  # both leave through device 0's port
    disjoint = build_gtg(
        {"reference/infer": ON0, "actor/generate": Layout.contiguous(first=2)},
        {"reference/infer": ON1, "actor/generate": Layout.contiguous(first=3)},
        models,
        {0: REF, 1: REF, 2: REF, 3: REF},
        link=link,
    )
    assert disjoint.critical_path_s == pytest.approx(total)
    for g in (shared, disjoint):
        for wave in g.waves:
            ports = [p for x in wave for p in g.op(x).ports]
            assert len(ports) == len(set(ports))


def test_validate_catches_a_broken_schedule() -> None:
    caps = {0: REF + REW, 1: REF}
    g = build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, caps)
    with pytest.raises(ScheduleInvalid, match="over its capacity"):
        g.validate({0: REF + REW, 1: REF - 1})
    alloc = "alloc:reference/infer:1"
    waves = tuple(tuple(x for x in w if x != alloc) for w in g.waves)
    broken = replace(g, waves=((alloc,), *waves))  # the alloc before the free it waits for
    with pytest.raises(ScheduleInvalid, match="does not point to a later wave"):
        broken.validate(caps)
    lost = next(op.id for op in g.ops if op.kind == "transfer")
    dropped = replace(
        g,
        ops=tuple(op for op in g.ops if op.id != lost),
        edges=tuple(e for e in g.edges if lost not in (e.before, e.after)),
        waves=tuple(w for w in (tuple(x for x in w if x != lost) for w in g.waves) if w),
    )
    with pytest.raises(ScheduleInvalid, match="not written exactly once"):
        dropped.validate(caps)


def test_a_source_freed_before_its_model_stage_s_targets_are_complete_is_refused() -> None:
    """Copy, then free: a live move keeps every old shard until all of the model-stage's pieces have
    moved, so a move that fails on a worker can fall back on plan A whole. A schedule that frees a
    source as soon as its own pieces left (a builder without that rule) is refused."""
    plan_a = {"actor/train": Layout(tp=2, devices=(0, 1))}
    plan_b = {"actor/train": Layout(tp=2, devices=(1, 2))}
    caps = dict.fromkeys((0, 1, 2), 10**9)
    g = build_gtg(plan_a, plan_b, {"actor/train": (LM, True)}, caps)
    g.validate(caps)
    wave_of = {x: i for i, w in enumerate(g.waves) for x in w}
    source = {
        op.id: op.src if op.kind == "transfer" else op.device
        for op in g.ops
        if op.kind in ("transfer", "copy")
    }

    def own_reads_only(d: int) -> tuple[Edge, ...]:
        """The edges of a builder that frees device d's source once its own pieces have left."""
        free = f"free:actor/train:{d}"
        return tuple(e for e in g.edges if e.after != free or source.get(e.before, d) == d)

    def earliest(d: int) -> int:
        return 1 + max(wave_of[e.before] for e in own_reads_only(d) if e.after == f"free:actor/train:{d}")

    d = min((0, 1), key=earliest)
    free, others = f"free:actor/train:{d}", [x for x, src in source.items() if src != d]
    assert others and all(wave_of[x] < wave_of[free] for x in others)  # the rule, as built
    assert earliest(d) <= max(wave_of[x] for x in others)  # freed early, it goes before the others
    waves = [tuple(x for x in w if x != free) for w in g.waves]
    waves[earliest(d)] += (free,)
    early = replace(g, edges=own_reads_only(d), waves=tuple(w for w in waves if w))
    with pytest.raises(
        ScheduleInvalid, match="frees a source shard before the model-stage's targets are complete"
    ):
        early.validate(caps)


def test_snapshot_writers_write_every_distinct_box_once() -> None:
    for layout in (Layout.contiguous(tp=2, dp=2), Layout(tp=1, pp=2, dp=2, devices=(3, 1, 0, 2))):
        smap = shard_map(LM, layout, train=True)
        written = [item for items in write_assignment(smap).values() for item in items]
        distinct = {(spec.name, piece.box) for spec in smap.tensors for piece in spec.pieces}
        assert len(written) == len(set(written)) == len(distinct)
        assert set(written) == distinct


def test_op_ids_are_stable_and_round_trip() -> None:
    g = build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, {0: REF + REW, 1: REF})
    again = build_gtg(SWAP_A, SWAP_B, SWAP_MODELS, {0: REF + REW, 1: REF})
    assert [op.id for op in g.ops] == [op.id for op in again.ops] and g.edges == again.edges
    transfer = next(op for op in g.ops if op.kind == "transfer")
    assert transfer.id == f"transfer:{transfer.stage}:{transfer.src}->{transfer.dst}:{transfer.tensor}:0"
    assert Op.from_dict(json.loads(json.dumps(transfer.to_dict()))) == transfer
    with pytest.raises(ValueError, match="does not match"):
        Op.from_dict({**transfer.to_dict(), "id": "transfer:x"})
