"""A placement's process groups serve every layout on it: two model-stages on the same slots with their
own micro-batch counts each get their own (the groups are cached by placement, ``Layout.key``)."""

from __future__ import annotations

import torch

from nereus_core.engine.device import DeviceContext
from nereus_core.layout import Layout
from tests.support.dist_utils import run_world


def _micro_batches_seen(rank: int, world: int) -> list[int]:
    ctx = DeviceContext(rank=rank, world_size=world, backend="gloo", device=torch.device("cpu"))
    one, four = (Layout.contiguous(dp=2, micro_batches=m) for m in (1, 4))
    assert one.key == four.key  # one placement
    built = [ctx.build_groups(one), ctx.build_groups(four)]
    seen = [g.layout.micro_batches for g in built] + [ctx.view(one).layout.micro_batches]
    seen.append(ctx.view(four).layout.micro_batches)
    assert built[0].dp_group is built[1].dp_group  # the groups themselves are built once
    return seen


def test_layouts_of_one_placement_keep_their_own_micro_batches() -> None:
    assert run_world(2, _micro_batches_seen) == [[1, 4, 1, 4]] * 2
