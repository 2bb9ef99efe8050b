"""tasks/model_ops: the job's ``passes:`` section reaches the engine's forward and train calls as its
``pack``/``max_tokens`` keywords, and a packed call's deadline counts the real tokens of the fullest
replica, not the padded ids (``DevicePool.scope``). A recording pool stands in for the devices."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nereus_core.config import PassesConfig
from nereus_core.engine.forward import forward_outputs
from nereus_core.engine.train import train_step
from nereus_core.layout import Layout
from tasks import model_ops

LAYOUT = Layout(dp=2, devices=(0, 1))
# Four rows of 8 columns, 3, 8, 5 and 2 real tokens (right-padded).
MASK = (torch.arange(8)[None, :] < torch.tensor([3, 8, 5, 2])[:, None]).float()
IDS = torch.arange(32).view(4, 8)


class RecordingPool:
    """What model_ops hands the pool: the scope's tokens, the function, its keywords and rows."""

    def __init__(self) -> None:
        self.scopes: list[tuple[str, int | None]] = []
        self.calls: list[tuple[Any, tuple[tuple[Any, ...], ...], dict[str, Any]]] = []

    @contextmanager
    def scope(self, label: str, *, tokens: int | None = None) -> Iterator[None]:
        self.scopes.append((label, tokens))
        yield

    def run(self, layout: Layout, fn: Any, /, per_rank_args: Any = None, **kwargs: Any) -> list[Any]:
        self.calls.append((fn, tuple(per_rank_args), kwargs))
        if fn is forward_outputs:  # each device's rows back, as the engine would give its outputs
            return [args[0].float() for args in per_rank_args]
        return [{"loss": float(args[0]["ids"].shape[0])} for args in per_rank_args]


def test_a_packed_forward_reaches_the_engine_and_counts_real_tokens() -> None:
    pool = RecordingPool()
    passes = PassesConfig(pack=True, max_tokens_per_device=64)
    out = model_ops.forward(pool, LAYOUT, IDS, name="reference/infer", attention_mask=MASK, passes=passes)
    ((fn, args, kwargs),) = pool.calls
    assert fn is forward_outputs
    assert kwargs == dict(name="reference/infer", pack=True, max_tokens=64, layout=LAYOUT)
    # Balanced rows: 8+2 on one replica, 5+3 on the other; the fullest holds 10 real tokens.
    held = sorted(int(a[1].sum()) for a in args)
    assert held == [8, 10] and pool.scopes == [("reference/infer", 10)]
    assert torch.equal(out, IDS.float())  # the rows come back in batch order


def test_a_padded_forward_leaves_the_deadline_to_the_ids_sent() -> None:
    pool = RecordingPool()
    model_ops.forward(pool, LAYOUT, IDS, name="actor/train", attention_mask=MASK)
    ((_, _, kwargs),) = pool.calls
    assert kwargs == dict(name="actor/train", pack=False, max_tokens=None, layout=LAYOUT)
    assert pool.scopes == [("actor/train", None)]  # the pool counts the ids, pads included


def test_a_packed_train_step_reaches_the_engine_and_counts_real_tokens() -> None:
    pool = RecordingPool()
    batch = {"ids": IDS, "attention_mask": MASK, "mask": MASK[:, 4:]}
    passes = PassesConfig(pack=True)
    stats = model_ops.train_stats(pool, LAYOUT, batch, name="actor/train", with_entropy=True, passes=passes)
    ((fn, _, kwargs),) = pool.calls
    assert fn is train_step
    assert (kwargs["pack"], kwargs["max_tokens"], kwargs["with_entropy"]) == (True, None, True)
    assert kwargs["layout"] == LAYOUT  # the plan's layout: the shard takes its micro-batches and schedule
    assert pool.scopes == [("actor/train", 10)] and stats == {"loss": 2.0}
