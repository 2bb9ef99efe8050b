"""tasks/reshard.py on a 4-device Dask pool: a train stage's whole state survives every reshard bit
for bit, by both paths, and training continues as it would have on the old layout."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

import storage
from nereus_core.engine import reshard as core_reshard
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.layout import Layout
from tasks import model_ops
from tasks.reshard import PATHS, gather_state, reshard, reshard_wave
from tasks.runtime.device_pool import DevicePool, DeviceRunError
from tests.support.runtime_setup import GQA_MODEL

# The per-rank helpers below travel to the workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = GQA_MODEL  # 8 query / 4 KV heads: tp=4 still splits the KV heads
# eps=1e-6: see tests/tasks/test_runtime.py (AdamW amplifies summation-order noise by lr/eps).
ADAMW = OptimizerSettings(lr=1e-3, eps=1e-6, weight_decay=0.01)
NAME = "actor/train"
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (4, 1, 1), (1, 4, 1)]
ALL_PAIRS = [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b]
# A default subset kept small for CI (pp down, dp up and down, tp up with pp down, mixed); ALL_PAIRS (slow)
# covers every ordered pair.
DEFAULT_PAIRS = [
    ((1, 4, 1), (1, 1, 1)),  # pp down
    ((1, 1, 1), (1, 1, 2)),  # dp up: ZeRO splits the moments
    ((2, 1, 2), (2, 1, 1)),  # dp down: ZeRO gathers them
    ((2, 2, 1), (1, 1, 2)),  # tp, pp down, dp up
    ((1, 1, 2), (2, 2, 1)),  # dp -> tp x pp
]
BATCHES = [
    torch.randint(0, CONFIG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(seed))
    for seed in range(3)
]


def _layout(dims: tuple[int, int, int]) -> Layout:
    tp, pp, dp = dims
    return Layout.contiguous(tp=tp, pp=pp, dp=dp, micro_batches=2 if pp > 1 else 1)


def _key(dims: tuple[int, int, int]) -> str:
    return "tp{}pp{}dp{}".format(*dims)


@pytest.fixture(scope="module")
def pool() -> Iterator[DevicePool]:
    with DevicePool(4, failure_grace_s=10.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def after_three_steps(pool: DevicePool) -> Any:
    """Parameters after three AdamW steps on a layout (the 'one more step on the old layout')."""
    cache: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}

    def get(dims: tuple[int, int, int]) -> dict[str, torch.Tensor]:
        if dims not in cache:
            layout = _layout(dims)
            model_ops.load_model(pool, layout, name="reference", config=CONFIG, optimizer=ADAMW)
            try:
                for ids in BATCHES:
                    model_ops.train(pool, layout, {"ids": ids}, name="reference")
                cache[dims] = model_ops.full_state(pool, layout, name="reference", config=CONFIG)
            finally:
                model_ops.unload_model(pool, layout, name="reference")
        return cache[dims]

    return get


def _check_reshard(
    pool: DevicePool, reference: Any, old_dims: Any, new_dims: Any, path: str, run_dir: Path
) -> None:
    old = _layout(old_dims)
    new = new_dims if isinstance(new_dims, Layout) else _layout(new_dims)
    model_ops.load_model(pool, old, name=NAME, config=CONFIG, optimizer=ADAMW)
    try:
        for ids in BATCHES[:2]:
            model_ops.train(pool, old, {"ids": ids}, name=NAME)
        before = gather_state(pool, old, name=NAME, config=CONFIG, train=True)
        stats = reshard(pool, NAME, CONFIG, old, new, path=path, optimizer=ADAMW, run_dir=run_dir)
        after = gather_state(pool, new, name=NAME, config=CONFIG, train=True)
        params = model_ops.full_state(pool, new, name=NAME, config=CONFIG)
        model_ops.train(pool, new, {"ids": BATCHES[2]}, name=NAME)
        stepped = model_ops.full_state(pool, new, name=NAME, config=CONFIG)
    finally:
        model_ops.unload_model(pool, new, name=NAME)
        model_ops.unload_model(pool, old, name=NAME)
    assert stats["bytes_moved"] + stats["bytes_local"] > 0 and stats["seconds"] > 0
    assert set(after) == set(before)
    differ = [k for k in before if not torch.equal(before[k], after[k])]
    assert not differ, f"{len(differ)} tensors changed, e.g. {differ[:3]}"
    assert before["optimizer:step"].item() == 2.0
    assert all(torch.equal(params[k], before[k]) for k in params)
    if path == "durable":
        on_disk = storage.read_full_state(run_dir, NAME.replace("/", "-"))
        assert all(torch.equal(on_disk[k], before[k]) for k in params)
    expected = reference(old_dims)
    worst = max((stepped[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"one more step after {old.key} -> {new.key} differs by {worst:.3g}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("old", "new"), DEFAULT_PAIRS, ids=lambda d: _key(d))
def test_reshard_keeps_state_bitwise_and_training_continues(
    pool: DevicePool, after_three_steps: Any, tmp_path: Path, old: Any, new: Any, path: str
) -> None:
    _check_reshard(pool, after_three_steps, old, new, path, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("old", "new"), ALL_PAIRS, ids=lambda d: _key(d))
def test_reshard_full_matrix(
    pool: DevicePool, after_three_steps: Any, tmp_path: Path, old: Any, new: Any, path: str
) -> None:
    _check_reshard(pool, after_three_steps, old, new, path, tmp_path)


@pytest.mark.parametrize("path", PATHS)
def test_train_stage_reshards_onto_devices_out_of_rank_order(
    pool: DevicePool, after_three_steps: Any, tmp_path: Path, path: str
) -> None:
    # ZeRO numbers a DP group's partitions by world rank (3 -> 1, 1 -> 0), the layout by position.
    new = Layout(tp=1, pp=2, dp=2, devices=(3, 0, 1, 2), micro_batches=2)
    _check_reshard(pool, after_three_steps, (2, 1, 2), new, path, tmp_path)


@pytest.mark.parametrize("path", PATHS)
def test_inference_stage_reshards_its_weights(pool: DevicePool, tmp_path: Path, path: str) -> None:
    old, new = _layout((2, 2, 1)), Layout(tp=4, pp=1, dp=1, devices=(3, 1, 0, 2))  # out of rank order
    model_ops.load_model(pool, old, name="reference/infer", config=CONFIG)
    try:
        before = gather_state(pool, old, name="reference/infer", config=CONFIG, train=False)
        logp = model_ops.forward(pool, old, BATCHES[0], name="reference/infer")
        reshard(pool, "reference/infer", CONFIG, old, new, path=path, run_dir=tmp_path)
        after = gather_state(pool, new, name="reference/infer", config=CONFIG, train=False)
        logp_after = model_ops.forward(pool, new, BATCHES[0], name="reference/infer")
    finally:
        model_ops.unload_model(pool, new, name="reference/infer")
        model_ops.unload_model(pool, old, name="reference/infer")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (logp - logp_after).abs().max().item() <= 1e-5


# One wave of three model-stages whose layouts overlap on devices: the train stages' ZeRO exchanges
# (old dp2 extract, new dp2 install) and DeepSpeed set-ups interleave with each other's transfers.
WAVE = [
    ("wave/actor", Layout.contiguous(tp=2), Layout(tp=1, pp=1, dp=2, devices=(1, 2)), ADAMW),
    (
        "wave/critic",
        Layout(tp=1, pp=1, dp=2, devices=(2, 3)),
        Layout(tp=2, pp=1, dp=1, devices=(3, 0)),
        ADAMW,
    ),
    (
        "wave/reference",
        Layout.contiguous(pp=2, micro_batches=2),
        Layout(tp=2, pp=1, dp=1, devices=(2, 3)),
        None,
    ),
]


@pytest.mark.timeout(600)
def test_a_wave_of_moves_runs_at_once_and_keeps_every_state_bitwise(pool: DevicePool) -> None:
    for name, old, _, optimizer in WAVE:
        model_ops.load_model(pool, old, name=name, config=CONFIG, optimizer=optimizer)
        if optimizer is not None:
            model_ops.train(pool, old, {"ids": BATCHES[0]}, name=name)
    try:
        before = {n: gather_state(pool, o, name=n, config=CONFIG, train=t is not None) for n, o, _, t in WAVE}
        logp = model_ops.forward(pool, WAVE[0][1], BATCHES[1], name=WAVE[0][0])
        stats = reshard_wave(pool, [(n, CONFIG, o, b, t) for n, o, b, t in WAVE])
        after = {n: gather_state(pool, b, name=n, config=CONFIG, train=t is not None) for n, _, b, t in WAVE}
        logp_after = model_ops.forward(pool, WAVE[0][2], BATCHES[1], name=WAVE[0][0])
        losses = [model_ops.train(pool, b, {"ids": BATCHES[2]}, name=n) for n, _, b, t in WAVE if t]
    finally:
        for name, old, new, _ in WAVE:
            for layout in (old, new):
                model_ops.unload_model(pool, layout, name=name)
    assert [s["bytes_moved"] > 0 for s in stats] == [True] * len(WAVE)
    for name in before:
        differ = [k for k in before[name] if not torch.equal(before[name][k], after[name][k])]
        assert before[name].keys() == after[name].keys() and not differ, f"{name}: {differ[:3]} changed"
    assert before["wave/critic"]["optimizer:step"].item() == 1.0
    assert (logp - logp_after).abs().max().item() <= 1e-5
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses)


def test_a_wave_refuses_one_stage_twice(pool: DevicePool) -> None:
    name, old, new, optimizer = WAVE[0]
    with pytest.raises(DeviceRunError, match="moves each model-stage once"):
        reshard_wave(pool, [(name, CONFIG, old, new, optimizer)] * 2)


def test_reshard_refuses_bad_requests(pool: DevicePool) -> None:
    old, new = _layout((1, 1, 1)), _layout((2, 1, 1))
    with pytest.raises(ValueError, match="path="):
        reshard(pool, NAME, CONFIG, old, new, path="teleport")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs run_dir"):
        reshard(pool, NAME, CONFIG, old, new, path="durable")


# ------------------------------------------------------------------- failures mid-transfer


class _FailingExchange:
    """Stands in for ``engine.exchange.Exchange``: raises, or kills the process, as transfers start."""

    die = False

    def __init__(self, **kwargs: Any) -> None:
        pass

    def recv(self, segments: Any) -> None:  # the first call of a reshard's transfers; send: the same
        if self.die:
            os._exit(1)
        raise RuntimeError(f"pid {os.getpid()} fails mid-transfer")

    send = recv


class _DyingExchange(_FailingExchange):
    die = True


def _sabotage(ctx: DeviceContext, exchange_class: type) -> None:
    """From now on this device's reshards use ``exchange_class`` for their transfers."""
    core_reshard.Exchange = exchange_class  # type: ignore[misc]


def test_a_rank_failing_mid_transfer_raises_in_the_driver(pool: DevicePool) -> None:
    """Runs last in this module: it leaves the pool with a dead worker (a second pool would cost
    half a minute to start on two cores)."""
    old, new = _layout((1, 1, 1)), _layout((2, 1, 1))
    for sabotage, timeout_s in ((_FailingExchange, 3.0), (_DyingExchange, 60.0)):
        model_ops.load_model(pool, old, name="m", config=CONFIG)
        pool.run_on([1], _sabotage, exchange_class=sabotage)
        start = time.monotonic()
        with pytest.raises(DeviceRunError) as info:
            reshard(pool, "m", CONFIG, old, new, timeout_s=timeout_s)
        seconds = time.monotonic() - start
        assert seconds < timeout_s + pool.failure_grace_s + 5, f"{sabotage.__name__}: took {seconds:.0f}s"
        assert 1 in [f.rank for f in info.value.failures]
        if sabotage is _FailingExchange:
            assert any("fails mid-transfer" in f.message for f in info.value.failures)
            pool.resize(pool.size)  # the timed-out gloo pair is closed: rebuild the world
        else:  # a dead peer closes its connections: no need to wait for the timeout
            assert seconds < timeout_s
