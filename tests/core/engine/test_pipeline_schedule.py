"""1F1B (``Layout.schedule``) and recomputation (``Layout.recompute``) give GPipe's training bit for bit: the
same losses, gradient norms and weights after two steps of a pp2 pipeline with four micro-batches, fp32 and
bf16 with fp32 masters, padded and packed (every schedule runs each micro-batch's backward oldest first, so
gradients add up in one order; a recomputed layer runs its forward again in backward, counted here). A plan
that changes only the schedule, the micro-batches or recomputation runs it on the placed shard
(``shard.bind_layout``)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from nereus_core.config import ModelConfig
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.dispatch import per_device_batch
from nereus_core.engine.optimizer import OptimizerSettings
from nereus_core.engine.shard import get_shard, load_shard, shard_state
from nereus_core.engine.train import train_step
from nereus_core.layout import Layout
from nereus_core.model.llama import DecoderLayer
from tests.support.dist_utils import run_world

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, seed=5)


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL.vocab_size, (8, 12), generator=gen)
    if not packed:
        return {"ids": ids}
    lengths = torch.tensor([12, 5, 9, 12, 3, 7, 11, 6])
    return {"ids": ids, "attention_mask": (torch.arange(12)[None, :] < lengths[:, None]).long()}


_LAYER_CALLS = [0]  # decoder-layer forwards run in this process (a recompute runs one more)
_layer_forward = DecoderLayer.forward


def _counted(self: DecoderLayer, *args: Any, **kwargs: Any) -> torch.Tensor:
    _LAYER_CALLS[0] += 1
    return _layer_forward(self, *args, **kwargs)


def _train(rank: int, world: int, dtype: str, packed: bool) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    DecoderLayer.forward = _counted  # type: ignore[method-assign]  # this rank's process only
    ctx = DeviceContext(rank=rank, world_size=world, backend="gloo", device=torch.device("cpu"))
    config = MODEL.model_copy(update={"dtype": dtype})
    out: dict[str, Any] = {}
    choices = {"gpipe": {}, "1f1b": {"schedule": "1f1b"}, "recompute": {"recompute": True}}
    for label, choice in choices.items():
        layout = Layout.contiguous(pp=2, micro_batches=4).model_copy(update=choice)
        ctx.build_groups(layout)
        name = f"actor-{label}"
        load_shard(ctx, name=name, layout=layout, config=config, optimizer=OptimizerSettings())
        part = per_device_batch(layout, _batch(packed))[rank]
        before = _LAYER_CALLS[0]
        losses = [train_step(ctx, part, name=name, pack=packed) for _ in range(2)]
        calls = _LAYER_CALLS[0] - before
        out[label] = {"losses": losses, "state": shard_state(ctx, name=name), "layer_calls": calls}
    # A plan that changes only the schedule and the micro-batches: the placed shard runs it.
    other = Layout.contiguous(pp=2, micro_batches=2).model_copy(update={"schedule": "1f1b"})
    train_step(ctx, per_device_batch(other, _batch(packed))[rank], name="actor-gpipe", layout=other)
    shard = get_shard(ctx, "actor-gpipe")
    out["rebound"] = (
        shard.layout.schedule,
        shard.layout.micro_batches,
        shard.engine.gradient_accumulation_steps(),
    )
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("dtype", "packed"), [("fp32", False), ("fp32", True), ("bf16", False)])
def test_1f1b_trains_as_gpipe(dtype: str, packed: bool) -> None:
    results = run_world(2, _train, dtype, packed, timeout_s=200)
    last = results[1]  # the last stage returns the losses
    for other in ("1f1b", "recompute"):
        assert last[other]["losses"] == last["gpipe"]["losses"]  # loss, statistics and grad norm
    assert last["gpipe"]["losses"][0]["loss"] != last["gpipe"]["losses"][1]["loss"]  # it learned
    for rank in results:
        gpipe = rank["gpipe"]["state"]
        for other in ("1f1b", "recompute"):
            state = rank[other]["state"]
            assert gpipe.keys() == state.keys() and all(torch.equal(gpipe[k], state[k]) for k in gpipe)
        # two steps of four micro-batches over this stage's 2 layers: 16 layer forwards, 16 more where
        # backward recomputes them
        assert (rank["gpipe"]["layer_calls"], rank["recompute"]["layer_calls"]) == (16, 32)
        assert rank["rebound"] == ("1f1b", 2, 2)
