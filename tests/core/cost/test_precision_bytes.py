"""The cost model (cost.geometry.value_bytes, cost.terms) and the GTG (gtg/build.py, graph.py) count
a ``model.dtype: bf16`` model's bytes as the EMU's shard maps size it; fp32 keeps the profile's."""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch

from nereus_core.config import ModelConfig, Workload
from nereus_core.cost.geometry import value_bytes
from nereus_core.cost.hardware import CPU_WORKERS, H100_SXM
from nereus_core.cost.stage_cost import estimate, model_stats
from nereus_core.emu import bytes_per_device, partitioned_kinds, plan_reshard, shard_map
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.dispatch import per_device_batch
from nereus_core.engine.memory import held_bytes
from nereus_core.engine.optimizer import OptimizerSettings
from nereus_core.engine.shard import drop_shard, load_shard
from nereus_core.engine.train import train_step
from nereus_core.gtg import TransitionInfeasible, build_gtg
from nereus_core.gtg.execution import stage_schedule
from nereus_core.layout import Layout
from tests.support.dist_utils import run_world
from tests.support.model_configs import SHARDABLE

FP32 = SHARDABLE
BF16 = FP32.model_copy(update={"dtype": "bf16"})
LAYOUTS = [
    Layout.contiguous(),
    Layout.contiguous(dp=2),
    Layout.contiguous(tp=2),
    Layout.contiguous(pp=2, micro_batches=2),
    Layout.contiguous(tp=2, dp=2),
    Layout.contiguous(tp=2, pp=2, dp=3, micro_batches=2),
]
WORK = Workload(batch=12, prompt_len=8, response_mean=6.0, response_high=8)
NO_LATENCY = CPU_WORKERS.model_copy(update={"collective_latency_s": 0.0})


def test_bf16_sizes_are_the_shard_maps_and_fp32_keeps_the_profiles() -> None:
    smap = shard_map(BF16, Layout.contiguous(dp=2), train=True)
    param = smap.tensors[0]
    state = sum(smap.tensor(f"{param.name}:{kind}").itemsize for kind in partitioned_kinds(BF16))
    for profile in (CPU_WORKERS, H100_SXM):
        got = value_bytes(model_stats(BF16), profile)
        assert (got.weight, got.grad, got.activation, got.kv) == (param.itemsize,) * 4 == (2,) * 4
        assert got.optimizer == state == 4 + 8  # fp32 master + two fp32 moments per parameter
        fp32 = value_bytes(model_stats(FP32), profile)
        assert (fp32.weight, fp32.grad, fp32.optimizer, fp32.activation, fp32.kv) == (
            profile.weight_bytes,
            profile.grad_bytes,
            profile.optimizer_bytes,
            profile.activation_bytes,
            profile.kv_bytes,
        )


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.key)
def test_bf16_train_memory_is_what_the_shard_map_holds(layout: Layout) -> None:
    mem = estimate("actor/train", layout, WORK, BF16, CPU_WORKERS).memory
    per = bytes_per_device(BF16, layout, train=True)
    assert mem.weights == max(k["params"] for k in per.values())
    # The shard map's gradients are the state a transition moves; the cost model's are what the step's
    # peak holds (ZeRO's fp32 bucket, and what backward has made beyond the freed activations).
    grads = max(k["grads"] for k in per.values())
    held = grads if layout.micro_batches > 1 else max(0, grads - mem.activations)  # beside later ones
    assert mem.gradients == 2 * grads + held
    # Margin: the cost model splits a device's parameters over dp as one flat range (ceil(n/dp));
    # the shard map splits each tensor's (emu.py: earlier dp ranks take the remainder), so the
    # busiest rank holds up to one element more per tensor, of 12 bytes, plus the 4-byte step count.
    busiest = max(per, key=lambda d: per[d]["params"] + per[d]["optimizer"])
    tensors = {spec.param for spec, _ in shard_map(BF16, layout, train=True).pieces_on(busiest)} - {""}
    held = per[busiest]["params"] + per[busiest]["optimizer"]
    cost = mem.weights + mem.optimizer
    assert 0 <= held - cost <= 12 * len(tensors) + 4, (held, cost)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.key)
def test_bf16_halves_weights_and_kv_and_keeps_the_optimizer_bytes(layout: Layout) -> None:
    mem16 = estimate("actor/train", layout, WORK, BF16, CPU_WORKERS).memory
    mem32 = estimate("actor/train", layout, WORK, FP32, CPU_WORKERS).memory
    assert 2 * mem16.weights == mem32.weights
    assert mem16.optimizer == mem32.optimizer  # the CPU profile's 12 counts DeepSpeed's fp32 master too
    # Per parameter of the busiest device: (2 + 12/dp) bytes against (4 + 12/dp).
    ratio = (2 + 12 / layout.dp) / (4 + 12 / layout.dp)
    assert mem16.persistent == pytest.approx(ratio * mem32.persistent, rel=1e-3)
    gen16 = estimate("actor/generate", layout, WORK, BF16, CPU_WORKERS).memory
    gen32 = estimate("actor/generate", layout, WORK, FP32, CPU_WORKERS).memory
    assert gen16.kv_cache > 0 and gen16.kv_cache == pytest.approx(gen32.kv_cache / 2, rel=1e-9, abs=1)


def test_bf16_halves_the_bytes_time_terms_move() -> None:
    layout = Layout.contiguous(dp=2)
    raw16 = estimate("actor/train", layout, WORK, BF16, NO_LATENCY).raw
    raw32 = estimate("actor/train", layout, WORK, FP32, NO_LATENCY).raw
    assert raw16["dp_comm"] > 0 and raw16["dp_comm"] == pytest.approx(raw32["dp_comm"] / 2, rel=1e-12)
    # Adam's traffic per parameter: (2*12 + 2 + 2)/dp + 2 bytes against (2*12 + 4 + 4)/dp + 4.
    assert raw16["optimizer"] == pytest.approx(raw32["optimizer"] * (28 / 2 + 2) / (32 / 2 + 4), rel=1e-12)
    gen16 = estimate("actor/generate", layout, WORK, BF16, NO_LATENCY).raw
    gen32 = estimate("actor/generate", layout, WORK, FP32, NO_LATENCY).raw
    assert gen16["decode"] > 0 and gen16["decode"] == pytest.approx(gen32["decode"] / 2, rel=1e-12)


def _models(config: ModelConfig) -> dict[str, tuple[ModelConfig, bool]]:
    return {"actor/train": (config, True), "reference/infer": (config, False)}


def _plans(a: Layout, b: Layout) -> tuple[dict[str, Layout], dict[str, Layout]]:
    return {s: a for s in _models(FP32)}, {s: b for s in _models(FP32)}


MOVES = [
    (Layout.contiguous(dp=2), Layout.contiguous(tp=2)),
    (Layout.contiguous(pp=2), Layout.contiguous(tp=2, dp=2)),
    (Layout.contiguous(tp=2, dp=2), Layout(tp=1, dp=4, devices=(2, 3, 4, 5))),
]


@pytest.mark.parametrize(("old", "new"), MOVES, ids=lambda layout: layout.key)
def test_bf16_gtg_moves_and_holds_what_the_live_reshard_does(old: Layout, new: Layout) -> None:
    caps = dict.fromkeys(range(8), 10**9)
    graph = build_gtg(*_plans(old, new), _models(BF16), caps)
    graph.validate(caps)
    assert graph.route == "live"
    sent: dict[str, int] = defaultdict(int)
    copied: dict[str, int] = defaultdict(int)
    for op in graph.ops:
        if op.kind == "transfer":
            sent[op.stage] += op.nbytes
        elif op.kind == "copy":
            copied[op.stage] += op.nbytes
    for stage, (config, train) in _models(BF16).items():
        plan = plan_reshard(shard_map(config, old, train=train), shard_map(config, new, train=train))
        assert sent[stage] == sum(t.nbytes for t in plan.transfers) == plan.bytes_moved
        assert copied[stage] == plan.bytes_local
        need = {d: sum(k.values()) for d, k in bytes_per_device(config, new, train=train).items()}
        allocs = {op.device: op.nbytes for op in graph.ops if op.kind == "alloc" and op.stage == stage}
        assert allocs == need
    assert sent["actor/train"] > 0  # the train stage's optimizer partitions move in every case
    # A 4-byte count moves the same elements (both are emu.min_bytes) but doubles the bf16 weights'.
    uniform = build_gtg(*_plans(old, new), _models(BF16), caps, dtype_bytes=4)
    weights = sum(op.nbytes for op in graph.ops if op.kind == "transfer" and ":" not in op.tensor)
    assert uniform.link_bytes - graph.link_bytes == weights


def test_bf16_gtg_goes_live_where_a_four_byte_count_would_not() -> None:
    old, new = MOVES[0]
    models = _models(BF16)
    held: dict[int, int] = defaultdict(int)
    for config, train in models.values():
        for layout in (old, new):
            for d, kinds in bytes_per_device(config, layout, train=train).items():
                held[d] += sum(kinds.values())
    caps = dict.fromkeys(range(2), max(held.values()))  # old and new shards at once, in bf16 sizes
    graph = build_gtg(*_plans(old, new), models, caps)
    graph.validate(caps)
    assert graph.route == "live" and max(graph.peak_bytes.values()) <= caps[0]
    assert max(stage_schedule(graph, caps).peak_bytes.values()) <= caps[0]
    # Counted at 4 bytes a value, the train stage's own old and new shards overflow the device, so the
    # live route is lost; with half the capacity not even plan B fits.
    assert build_gtg(*_plans(old, new), models, caps, dtype_bytes=4).route != "live"
    with pytest.raises(TransitionInfeasible, match="cannot hold plan B"):
        build_gtg(*_plans(old, new), models, dict.fromkeys(range(2), caps[0] // 2), dtype_bytes=4)


@pytest.mark.parametrize(("old", "new"), MOVES, ids=lambda layout: layout.key)
def test_fp32_gtg_is_the_four_byte_one(old: Layout, new: Layout) -> None:
    caps = dict.fromkeys(range(8), 10**9)
    graph = build_gtg(*_plans(old, new), _models(FP32), caps)
    four = build_gtg(*_plans(old, new), _models(FP32), caps, dtype_bytes=4)
    assert graph.to_dict() == four.to_dict() and graph.link_bytes == four.link_bytes > 0


def _held_world(rank: int, world: int) -> dict[str, int]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # DeepSpeed reads them; the world exists
    ctx = DeviceContext(rank=rank, world_size=world, backend="gloo", device=torch.device("cpu"))
    out = {}
    for layout in ENGINE_LAYOUTS:
        ctx.build_groups(layout)  # collective: every rank, member or not
        if rank not in layout.devices:
            continue
        name = f"actor/train/{layout.key}"
        load_shard(ctx, name=name, layout=layout, config=BF16, optimizer=OptimizerSettings(lr=1e-2))
        ids = torch.randint(0, BF16.vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))
        train_step(ctx, per_device_batch(layout, {"ids": ids})[layout.devices.index(rank)], name=name)
        out[layout.key] = held_bytes(ctx)
        drop_shard(ctx, name=name)
    return out


ENGINE_LAYOUTS = [Layout.contiguous(dp=2), Layout.contiguous(tp=2), Layout.contiguous(pp=2, micro_batches=2)]


@pytest.mark.timeout(300)
def test_bf16_train_state_is_what_the_engine_holds() -> None:
    """Between steps DeepSpeed holds the bf16 weights, its fp32 master partition and moments (the
    gradients are freed): the cost model's resident bytes plus two fp32 scalars (the step count and
    the gradient norm). This model's partitions split evenly, so DeepSpeed adds no alignment padding
    and the cost model's flat ceil(n/dp) share is exact."""
    results = run_world(2, _held_world, timeout_s=280)
    for layout in ENGINE_LAYOUTS:
        mem = estimate("actor/train", layout, WORK, BF16, CPU_WORKERS).memory
        held = max(r[layout.key] for r in results if layout.key in r)  # the busiest device, as estimated
        assert held - mem.persistent == 8, (layout.key, held, mem.persistent)


def test_transition_and_sync_bytes_follow_the_dtype() -> None:
    """The layouts-only transition estimates (reshard bytes, durable reads, weight sync) count bf16
    weights at 2 bytes and a train stage's optimizer state at 12 (masters and moments), as the shard
    maps do; fp32 keeps the profile's."""
    from nereus_core.cost.transition_cost import TransitionCosts, durable_seconds, reshard_bytes, sync_seconds

    old, new = Layout.contiguous(), Layout(tp=2, pp=1, dp=1, devices=(2, 3))  # new devices: all of it
    params = model_stats(FP32).total_params
    for stage in ("actor/generate", "actor/train"):
        for config in (FP32, BF16):
            per = value_bytes(model_stats(config), CPU_WORKERS)
            state = params * per.optimizer / 2 if stage == "actor/train" else 0
            expected = params * per.weight / 2 + state
            assert reshard_bytes(stage, old, new, config, CPU_WORKERS) == pytest.approx(expected, abs=1)
    assert value_bytes(model_stats(BF16), CPU_WORKERS).weight == 2
    assert value_bytes(model_stats(BF16), CPU_WORKERS).optimizer == 12
    costs = TransitionCosts(world_rebuild_s=0.0, engine_s=0.0, store_read_bandwidth=1.0)
    plan = {"actor/train": old, "reference/infer": old}
    reads = {
        c.dtype: durable_seconds(plan, {"actor": c, "reference": c}, CPU_WORKERS, costs) for c in (FP32, BF16)
    }
    fp32 = CPU_WORKERS.weight_bytes
    assert reads["fp32"] == params * (2 * fp32 + CPU_WORKERS.optimizer_bytes)
    assert reads["bf16"] == params * (2 + 12 + 2)
    wide = dict.fromkeys(plan, new)  # tp 2: each device reads half of every shard
    halved = durable_seconds(wide, {"actor": BF16, "reference": BF16}, CPU_WORKERS, costs)
    assert halved == pytest.approx(reads["bf16"] / 2, abs=2)
    sync = {c.dtype: sync_seconds(c, CPU_WORKERS, 1, 1, link=[0, 1]) for c in (FP32, BF16)}
    latency = CPU_WORKERS.collective_latency_s
    assert sync["bf16"] - latency == pytest.approx((sync["fp32"] - latency) / 2)
