"""What tasks/reshard.py sends each device with a reshard or a weight sync: the shard maps and the
plan travel as their recipes (a few hundred bytes, not the plan's transfers) and a process that
never saw them rebuilds them exactly."""

from __future__ import annotations

import pickle

import pytest

from nereus_core import emu
from nereus_core.emu import plan_reshard, shard_map
from nereus_core.engine.reshard import ReshardJob
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.layout import Layout
from tests.support.runtime_setup import GQA_MODEL

CONFIG = GQA_MODEL
MOVES = [
    (Layout.contiguous(tp=2), Layout.contiguous(tp=4), False),
    (Layout.contiguous(tp=2, pp=2, micro_batches=2), Layout.contiguous(tp=4), False),
    (Layout.contiguous(dp=2), Layout.contiguous(tp=2, pp=2, micro_batches=2), True),
]


@pytest.mark.parametrize(("old", "new", "train"), MOVES)
def test_a_job_and_its_plan_travel_as_recipes_and_are_rebuilt_exactly(
    old: Layout, new: Layout, train: bool
) -> None:
    old_map, new_map = shard_map(CONFIG, old, train=train), shard_map(CONFIG, new, train=train)
    plan = plan_reshard(old_map, new_map)
    job = ReshardJob("actor/train", CONFIG, old_map, new_map, OptimizerSettings() if train else None)
    payload = pickle.dumps((job, plan))
    assert len(payload) < 2048 < len(pickle.dumps(plan.transfers))

    emu._shard_map.cache_clear()  # as in a worker process that never built them
    emu.plan_reshard.cache_clear()
    job_there, plan_there = pickle.loads(payload)
    assert plan_there is not plan and job_there.old_map is not old_map
    assert job_there.old_map.tensors == old_map.tensors and job_there.new_map.tensors == new_map.tensors
    assert (plan_there.transfers, plan_there.local) == (plan.transfers, plan.local)
    assert (plan_there.bytes_moved, plan_there.bytes_local) == (plan.bytes_moved, plan.bytes_local)
    assert plan_reshard(job_there.old_map, job_there.new_map) is plan_there  # planned once per process


def test_shard_maps_are_equal_exactly_when_their_recipes_are() -> None:
    layout = Layout.contiguous(tp=2)
    emu._shard_map.cache_clear()
    first = shard_map(CONFIG, layout, train=True)
    emu._shard_map.cache_clear()
    again = shard_map(CONFIG, layout, train=True)
    assert again is not first and again == first and hash(again) == hash(first)
    assert shard_map(CONFIG, layout, train=False) != first
    assert shard_map(CONFIG, layout, train=True, dtype_bytes=2) != first
    assert shard_map(CONFIG, Layout.contiguous(tp=2, dp=2), train=True) != first
