"""A bf16 train stage (``model.dtype: bf16``) on a 2-device Dask pool: its bf16 weights, fp32 master
weights, fp32 moments and step count survive every reshard bit for bit, live and durable (the
durable path through the Arrow snapshot store), and the masters are carried, not rebuilt."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
import torch

import storage
from nereus_core.config import ModelConfig
from nereus_core.emu import MASTER, partitioned_kinds, split_state_name
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
    seed=11,
    dtype="bf16",
)
ADAMW = OptimizerSettings(lr=1e-3, eps=1e-6, weight_decay=0.01)
NAME = "actor/train"
# (tp, pp, dp) -> (tp, pp, dp): dp, tp and pp each up and down.
PAIRS = [
    ((1, 1, 1), (1, 1, 2)),
    ((1, 1, 2), (1, 1, 1)),
    ((1, 1, 1), (2, 1, 1)),
    ((2, 1, 1), (1, 1, 1)),
    ((1, 1, 1), (1, 2, 1)),
    ((1, 2, 1), (1, 1, 1)),
]
BATCHES = [
    torch.randint(0, CONFIG.vocab_size, (4, 10), generator=torch.Generator().manual_seed(seed))
    for seed in range(3)
]


def _layout(dims: tuple[int, int, int], first: int = 0) -> Layout:
    tp, pp, dp = dims
    return Layout.contiguous(tp=tp, pp=pp, dp=dp, first=first, micro_batches=2 if pp > 1 else 1)


def _key(dims: tuple[int, int, int]) -> str:
    return "tp{}pp{}dp{}".format(*dims)


@pytest.fixture(scope="module")
def pool() -> Iterator[DevicePool]:
    with DevicePool(2, failure_grace_s=10.0) as pool:
        yield pool


def _check_kinds(state: dict[str, torch.Tensor]) -> None:
    """bf16 weights, fp32 masters and moments; the masters hold bits the weights do not."""
    finer = 0
    for name, tensor in state.items():
        param, kind = split_state_name(name)
        want = torch.bfloat16 if kind == "param" else torch.float32
        assert tensor.dtype is want, f"{name}: {tensor.dtype}"
        if kind == MASTER:
            assert torch.equal(tensor.to(torch.bfloat16), state[param]), f"{name} is not the weights' master"
            finer += not torch.equal(tensor, state[param].float())
    assert finer > 0, "no master differs from its bf16 weights: the test would not see a rebuilt master"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("old", "new"), PAIRS, ids=lambda d: _key(d))
def test_bf16_state_reshards_bitwise(
    pool: DevicePool, tmp_path: Path, old: tuple, new: tuple, path: str
) -> None:
    old_layout, new_layout = _layout(old), _layout(new)
    model_ops.load_model(pool, old_layout, name=NAME, config=CONFIG, optimizer=ADAMW)
    try:
        for ids in BATCHES[:2]:
            model_ops.train(pool, old_layout, {"ids": ids}, name=NAME)
        before = gather_state(pool, old_layout, name=NAME, config=CONFIG, train=True)
        reshard(pool, NAME, CONFIG, old_layout, new_layout, path=path, optimizer=ADAMW, run_dir=tmp_path)
        after = gather_state(pool, new_layout, name=NAME, config=CONFIG, train=True)
    finally:
        model_ops.unload_model(pool, new_layout, name=NAME)
        model_ops.unload_model(pool, old_layout, name=NAME)
    assert {split_state_name(n)[1] for n in before} == {"param", "step", *partitioned_kinds(CONFIG)}
    _check_kinds(before)
    assert set(after) == set(before)
    differ = [
        k for k in before if not (after[k].dtype == before[k].dtype and torch.equal(before[k], after[k]))
    ]
    assert not differ, f"{len(differ)} tensors changed, e.g. {differ[:3]}"
    assert before["optimizer:step"].item() == 2.0
    if path == "durable":
        on_disk = storage.read_full_state(tmp_path, NAME.replace("/", "-"), optimizer=True)
        assert set(on_disk) == set(before)
        assert all(on_disk[k].dtype == before[k].dtype and torch.equal(on_disk[k], before[k]) for k in before)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", PATHS)
def test_carried_masters_give_the_same_next_step(pool: DevicePool, tmp_path: Path, path: str) -> None:
    """Two copies trained alike; one moves to the other device (same shape, so the same arithmetic).
    Their next step must agree bit for bit: a master rebuilt from the bf16 weights would not."""
    here, there = _layout((1, 1, 1)), _layout((1, 1, 1), first=1)
    names = ("stay", "move")
    for name in names:
        model_ops.load_model(pool, here, name=name, config=CONFIG, optimizer=ADAMW)
    try:
        for ids in BATCHES[:2]:
            for name in names:
                model_ops.train(pool, here, {"ids": ids}, name=name)
        reshard(pool, "move", CONFIG, here, there, path=path, optimizer=ADAMW, run_dir=tmp_path)
        model_ops.train(pool, here, {"ids": BATCHES[2]}, name="stay")
        model_ops.train(pool, there, {"ids": BATCHES[2]}, name="move")
        stay = gather_state(pool, here, name="stay", config=CONFIG, train=True)
        move = gather_state(pool, there, name="move", config=CONFIG, train=True)
        # Weights come back as a dict of bf16 tensors too (Dask's serializer goes through numpy).
        params = model_ops.full_state(pool, there, name="move", config=CONFIG)
    finally:
        model_ops.unload_model(pool, there, name="move")
        for name in names:
            model_ops.unload_model(pool, here, name=name)
    _check_kinds(stay)
    assert params and all(t.dtype is torch.bfloat16 and torch.equal(t, move[k]) for k, t in params.items())
    differ = [k for k in stay if not torch.equal(stay[k], move[k])]
    assert not differ, f"the next step differs after the move: {differ[:3]}"
