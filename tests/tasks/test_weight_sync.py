"""Weight sync through the EMU reshard on a 4-device Dask pool: after a train step the inference copy
on another layout holds the train stage's parameters bit for bit, only the bytes it lacked moved,
the optimizer state stayed where it was, and nothing went through the driver."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from nereus_core.emu import min_bytes, shard_map
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.layout import Layout
from tasks import model_ops, step_tasks
from tasks.reshard import gather_state, sync_copy
from tasks.runtime.device_pool import DevicePool, DeviceRunError
from tests.support.runtime_setup import GQA_MODEL

CONFIG = GQA_MODEL.model_copy(update={"seed": 5})
ADAMW = OptimizerSettings(lr=1e-3, eps=1e-6)
IDS = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
TRAIN, COPY = "actor/train", "actor/generate"
CASES = {
    # train layout, copy layout
    "tp2_to_tp1dp2": (Layout.contiguous(tp=2), Layout(tp=1, pp=1, dp=2, devices=(2, 3))),
    "pp2_to_tp2": (Layout.contiguous(pp=2, micro_batches=2), Layout(tp=2, pp=1, dp=1, devices=(2, 3))),
    # devices 1 and 2 hold both: device 1 copies its own slices locally, receives only the rest
    "tp2_to_tp1dp2_overlapping": (Layout.contiguous(tp=2), Layout(tp=1, pp=1, dp=2, devices=(1, 2))),
    # a train stage with ZeRO-partitioned moments, onto the same devices in another order
    "tp1pp2dp2_to_tp2": (
        Layout.contiguous(pp=2, dp=2, micro_batches=2),
        Layout(tp=2, pp=1, dp=1, devices=(3, 0)),
    ),
}


@pytest.fixture(scope="module")
def pool() -> Iterator[DevicePool]:
    with DevicePool(4, failure_grace_s=10.0) as pool:
        yield pool


def _params(pool: DevicePool, layout: Layout, name: str) -> dict[str, torch.Tensor]:
    """The parameters of ``name`` (a train stage's without its optimizer state), checked across replicas."""
    state = gather_state(pool, layout, name=name, config=CONFIG, train=name == TRAIN)
    return {k: v for k, v in state.items() if k in shard_map(CONFIG, layout, train=False).names}


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_makes_the_copy_equal_the_train_stage_bitwise(pool: DevicePool, case: str) -> None:
    train, copy = CASES[case]
    model_ops.load_model(pool, train, name=TRAIN, config=CONFIG, optimizer=ADAMW)
    model_ops.load_model(pool, copy, name=COPY, config=CONFIG)
    try:
        model_ops.train(pool, train, {"ids": IDS}, name=TRAIN)
        stale = _differing(_params(pool, train, TRAIN), _params(pool, copy, COPY))
        before = gather_state(pool, train, name=TRAIN, config=CONFIG, train=True)
        stats = sync_copy(pool, CONFIG, source=TRAIN, source_layout=train, copy=COPY, copy_layout=copy)
        synced = _params(pool, copy, COPY)
        after = gather_state(pool, train, name=TRAIN, config=CONFIG, train=True)
        logp_train = model_ops.forward(pool, train, IDS, name=TRAIN)
        logp_copy = model_ops.forward(pool, copy, IDS, name=COPY)
    finally:
        model_ops.unload_model(pool, copy, name=COPY)
        model_ops.unload_model(pool, train, name=TRAIN)
    assert stale, "the train step changed nothing: the test could not tell a sync from none"
    assert not _differing({k: before[k] for k in synced}, synced), "the copy differs from the train stage"
    assert not _differing(before, after), "the sync changed the train stage's state"
    least = min_bytes(shard_map(CONFIG, train, train=False), shard_map(CONFIG, copy, train=False))
    assert stats["bytes_moved"] == least == stats["bytes_sent"]  # only what each destination lacked
    assert (stats["bytes_local"] > 0) == bool(set(train.devices) & set(copy.devices))
    assert (logp_train - logp_copy).abs().max().item() <= 1e-5


def test_sync_creates_a_copy_on_a_new_layout(pool: DevicePool) -> None:
    """The relink after a transition: the copy is built on its layout from the train stage's slices."""
    train, copy = CASES["pp2_to_tp2"]
    model_ops.load_model(pool, train, name=TRAIN, config=CONFIG, optimizer=ADAMW)
    try:
        model_ops.train(pool, train, {"ids": IDS}, name=TRAIN)
        sync_copy(pool, CONFIG, source=TRAIN, source_layout=train, copy=COPY, copy_layout=copy, create=True)
        assert not _differing(_params(pool, train, TRAIN), _params(pool, copy, COPY))
    finally:
        model_ops.unload_model(pool, copy, name=COPY)
        model_ops.unload_model(pool, train, name=TRAIN)


def test_the_step_sync_never_gathers_the_state_to_the_driver(
    pool: DevicePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("weight sync went through the driver")

    train, copy = CASES["tp2_to_tp1dp2"]
    model_ops.load_model(pool, train, name=TRAIN, config=CONFIG, optimizer=ADAMW)
    model_ops.load_model(pool, copy, name=COPY, config=CONFIG)
    try:
        model_ops.train(pool, train, {"ids": IDS}, name=TRAIN)
        for name in ("full_state", "push_weights", "load_model"):
            monkeypatch.setattr(model_ops, name, refuse)
        step_tasks.sync_inference_copy(pool, train, copy, src_name=TRAIN, dst_name=COPY, config=CONFIG)
        monkeypatch.undo()
        assert not _differing(_params(pool, train, TRAIN), _params(pool, copy, COPY))
    finally:
        monkeypatch.undo()
        model_ops.unload_model(pool, copy, name=COPY)
        model_ops.unload_model(pool, train, name=TRAIN)


def test_sync_refuses_a_copy_resident_on_another_layout(pool: DevicePool) -> None:
    train, copy = CASES["tp2_to_tp1dp2"]
    elsewhere = Layout(tp=2, pp=1, dp=1, devices=(2, 3))
    model_ops.load_model(pool, train, name=TRAIN, config=CONFIG, optimizer=ADAMW)
    model_ops.load_model(pool, elsewhere, name=COPY, config=CONFIG)
    try:
        with pytest.raises(DeviceRunError) as info:
            sync_copy(
                pool, CONFIG, source=TRAIN, source_layout=train, copy=COPY, copy_layout=copy, timeout_s=5.0
            )
    finally:
        model_ops.unload_model(pool, elsewhere, name=COPY)
        model_ops.unload_model(pool, train, name=TRAIN)
    pool.resize(pool.size)  # the train devices' sends were left unmatched: a fresh world
    refused = {f.rank for f in info.value.failures if "reload it on the plan's layout" in f.message}
    assert refused == set(copy.devices)
