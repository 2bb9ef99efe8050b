"""Train stages sharded ``full`` over dp (DeepSpeed ZeRO-3, ``Layout.shard``) on a 4-device Dask pool.

- They train as the unsharded layout does: the same losses, gradient norms and weights within 1e-6
  relative after 3 steps (ZeRO-3 reduce-scatters where ZeRO-1 all-reduces: not bit for bit).
- Their state moves bit for bit along whole -> sharded dp2 -> sharded dp4 -> whole tp2, weights,
  moments and step count, live and durable, fp32 and bf16 with fp32 masters; each layout's
  state is read back from the live devices, never from the store.
- Each rank holds only its share: the state read per device is a 1/dp part of the whole.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
import torch

from nereus_core.config import ModelConfig
from nereus_core.emu import bytes_per_device, split_state_name
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.layout import Layout
from tasks import model_ops
from tasks.reshard import PATHS, gather_state, reshard
from tasks.runtime.device_pool import DevicePool

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    seed=13,
)
ADAMW = OptimizerSettings(lr=1e-3, eps=1e-6, weight_decay=0.01)
BATCHES = [
    torch.randint(0, CONFIG.vocab_size, (8, 10), generator=torch.Generator().manual_seed(seed))
    for seed in range(4)
]


def _layout(tp: int = 1, dp: int = 1, shard: str = "optimizer", micro_batches: int = 1) -> Layout:
    layout = Layout.contiguous(tp=tp, dp=dp, micro_batches=micro_batches)
    return layout.model_copy(update={"shard": shard})


@pytest.fixture(scope="module")
def pool() -> Iterator[DevicePool]:
    with DevicePool(4, failure_grace_s=10.0) as pool:
        yield pool


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in the Frobenius norm (a tensor's relative error, as ``torch.testing``'s)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.timeout(600)
def test_sharded_dp2_trains_as_unsharded(pool: DevicePool) -> None:
    whole, sharded = _layout(dp=2, micro_batches=2), _layout(dp=2, shard="full", micro_batches=2)
    stats, states = {}, {}
    for label, layout in (("whole", whole), ("sharded", sharded)):
        model_ops.load_model(pool, layout, name=label, config=CONFIG, optimizer=ADAMW)
        try:
            stats[label] = [
                model_ops.train_stats(pool, layout, {"ids": ids}, name=label) for ids in BATCHES[:3]
            ]
            states[label] = gather_state(pool, layout, name=label, config=CONFIG, train=True)
        finally:
            model_ops.unload_model(pool, layout, name=label)
    assert stats["whole"][0]["loss"] != stats["whole"][2]["loss"]  # it learned
    for a, b in zip(stats["sharded"], stats["whole"], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-6 * abs(b[key]), (key, a[key], b[key])
    assert states["sharded"].keys() == states["whole"].keys()
    errors = {k: _relative(states["sharded"][k], states["whole"][k]) for k in states["whole"]}
    far = {k: e for k, e in errors.items() if e > 1e-6}
    assert not far, f"{len(far)} tensors differ beyond 1e-6 relative: {far}"
    # the weights moved at all, and not identically to the bit (ZeRO-3 sums its gradients otherwise)
    assert not torch.equal(
        states["sharded"]["model.norm.weight"], torch.ones_like(states["sharded"]["model.norm.weight"])
    )


def test_sharded_layouts_hold_a_share_of_the_weights() -> None:
    whole = bytes_per_device(CONFIG, _layout(dp=4), train=True)[0]
    sharded = bytes_per_device(CONFIG, _layout(dp=4, shard="full"), train=True)
    total = sum(b["params"] for b in sharded.values())
    assert total == whole["params"]  # each weight once over the four ranks
    assert max(b["params"] for b in sharded.values()) <= whole["params"] / 4 + 64 * 4 * 4  # a row of padding


CHAIN = [_layout(), _layout(dp=2, shard="full"), _layout(dp=4, shard="full"), _layout(tp=2)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("path", PATHS)
def test_state_moves_bitwise_through_sharded_layouts(
    pool: DevicePool, tmp_path: Path, path: str, dtype: str
) -> None:
    config = CONFIG.model_copy(update={"dtype": dtype})
    name = "actor/train"
    layouts = CHAIN
    model_ops.load_model(pool, layouts[0], name=name, config=config, optimizer=ADAMW)
    held = layouts[0]
    try:
        for step, (old, new) in enumerate(itertools.pairwise(layouts)):
            model_ops.train(pool, old, {"ids": BATCHES[step]}, name=name)
            before = gather_state(pool, old, name=name, config=config, train=True)
            reshard(pool, name, config, old, new, path=path, optimizer=ADAMW, run_dir=tmp_path, step=step)
            held = new
            after = gather_state(pool, new, name=name, config=config, train=True)
            assert after.keys() == before.keys()
            differ = [
                k
                for k in before
                if not (after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]))
            ]
            assert not differ, f"{old.key}/{old.shard} -> {new.key}/{new.shard}: {differ[:3]} changed"
            assert before["optimizer:step"].item() == step + 1
            kinds = {split_state_name(n)[1] for n in before}
            assert kinds >= {"param", "exp_avg", "exp_avg_sq", "step"}
        # and it trains on from the last layout
        loss = model_ops.train(pool, held, {"ids": BATCHES[3]}, name=name)
        assert loss == loss
    finally:
        model_ops.unload_model(pool, held, name=name)


@pytest.mark.timeout(600)
def test_moved_state_trains_on_as_if_it_had_stayed(pool: DevicePool) -> None:
    """Two copies trained alike on whole dp2; one moves to sharded dp2 on the same devices. Their next
    step agrees within 1e-6: the moments and the step count (Adam's bias correction) were installed
    into ZeRO-3's partitions, not left at zero."""
    whole, sharded = _layout(dp=2), _layout(dp=2, shard="full")
    for name in ("stay", "move"):
        model_ops.load_model(pool, whole, name=name, config=CONFIG, optimizer=ADAMW)
    try:
        for ids in BATCHES[:2]:
            for name in ("stay", "move"):
                model_ops.train(pool, whole, {"ids": ids}, name=name)
        reshard(pool, "move", CONFIG, whole, sharded, optimizer=ADAMW)
        model_ops.train(pool, whole, {"ids": BATCHES[2]}, name="stay")
        model_ops.train(pool, sharded, {"ids": BATCHES[2]}, name="move")
        stay = gather_state(pool, whole, name="stay", config=CONFIG, train=True)
        move = gather_state(pool, sharded, name="move", config=CONFIG, train=True)
    finally:
        model_ops.unload_model(pool, whole, name="stay")
        model_ops.unload_model(pool, whole, name="move")
        model_ops.unload_model(pool, sharded, name="move")
    assert move["optimizer:step"].item() == 3.0
    errors = {k: _relative(move[k], stay[k]) for k in stay if k != "optimizer:step"}
    assert max(errors.values()) <= 1e-6, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
