"""The device pool changes size in one driver: a grow and a shrink, and a grow prepared while the
world runs (its new workers started and warmed ahead), failed or not needed."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from typing import Any

import cloudpickle
import pytest

from nereus_core.engine.device import DeviceContext
from nereus_core.layout import Layout
from tasks.runtime.device_pool import DevicePool
from tasks.runtime.pool_workers import wait_until
from tests.support.pool_checks import child_pids, keep, tp_sum, warm_note, worker_pids, world_sum

# The per-rank helpers below travel to the workers by value: the workers need
# not be able to import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow  # ~30 s; the prepared grow below and test_transition.py's shrink run by default
def test_grow_and_shrink_in_one_driver() -> None:
    # A handler of its own: a LocalCluster's silence_logs sets the level of the "distributed"
    # logger's stream handlers, which under pytest include the capture handlers caplog reads.
    said, pool_log = logging.handlers.BufferingHandler(10_000), logging.getLogger("tasks.runtime.device_pool")
    level = pool_log.level
    pool_log.addHandler(said)
    pool_log.setLevel(logging.INFO)
    before = child_pids()
    with DevicePool(2) as pool:
        pool.run_all(keep, key="shard")
        first = worker_pids(pool)

        pool.resize(4)
        assert pool.run_all(world_sum) == [(r, 4, 10.0) for r in range(4)]
        assert worker_pids(pool).items() >= first.items()  # survivors: same workers, same processes
        assert pool.cold_ranks == (2, 3)  # started by the resize itself: nobody warmed them
        assert list(pool.workers[:2]) == list(first)  # ... and the same ranks
        infos = pool.info()
        assert [i["resident"] for i in infos] == [["shard"], ["shard"], [], []]
        layout = Layout.contiguous(tp=2, dp=2)
        pool.build_groups(layout)
        assert pool.run(layout, tp_sum, layout=layout) == [((0, 1), 1.0)] * 2 + [((2, 3), 5.0)] * 2

        leaving = set(worker_pids(pool).values()) - set(first.values())
        pool.resize(2)
        assert pool.built_layouts == ()
        assert pool.run_all(world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]
        assert worker_pids(pool) == first
        # The workers that left the world retire after the switch, not during the resize.
        assert leaving <= child_pids()
        assert pool.retire_left() > 0 and pool.retire_left() == 0.0
        assert wait_until(lambda: not leaving & child_pids(), 30.0)  # their processes exit
        assert child_pids() - before == set(first.values())
        assert [e for e, _ in pool.timings if e.startswith("rebuild")] == ["rebuild 2->4", "rebuild 4->2"]
    assert child_pids() == before
    pool_log.removeHandler(said)
    pool_log.setLevel(level)
    assert any(r.getMessage() == "device pool resized 2 -> 4" for r in said.buffer)


def warm_fails(ctx: DeviceContext) -> None:
    raise RuntimeError(f"no warm-up on rank {ctx.rank}")


def marks(pool: DevicePool) -> list[Any]:
    return pool.run_all(lambda ctx: ctx.resident.get("warmed"))


def test_a_prepared_grow_starts_and_warms_the_new_workers_while_the_world_runs() -> None:
    before = child_pids()
    with DevicePool(2) as pool:
        pool.prepare(4, warm=warm_note)
        # The pool's world of 2 keeps working while the new workers start and warm in their own.
        for _ in range(5):
            assert pool.run_all(world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]
        first = worker_pids(pool)
        pool.resize(4)
        assert pool.run_all(world_sum) == [(r, 4, 10.0) for r in range(4)]
        assert pool.cold_ranks == ()  # every new rank was warmed before it joined
        # Ranks 2 and 3 ran the warm-up as ranks 0 and 1 of a world of two: the new workers only.
        assert marks(pool) == [None, None, (0, 2, 3.0), (1, 2, 3.0)]
        assert worker_pids(pool).items() >= first.items()
        # The prepared workers, no others.
        assert child_pids() - before == set(worker_pids(pool).values())
        events = [e for e, _ in pool.timings]
        assert events.index("prepare 4") < events.index("rebuild 2->4")
    assert child_pids() == before


def test_a_failed_or_unneeded_preparation_leaves_the_pool_correct() -> None:
    before = child_pids()
    with DevicePool(2) as pool:
        pool.prepare(4, warm=warm_fails)
        pool.resize(3)  # the warm-up failed: its workers still serve, cold; the one not needed goes
        assert pool.run_all(world_sum) == [(r, 3, 6.0) for r in range(3)]
        assert pool.cold_ranks == (2,)
        workers = set(worker_pids(pool).values())
        pool.retire_left()  # rank 3's worker, placed but not needed, retires
        assert wait_until(lambda: child_pids() - before == workers, 15.0)
        pool.prepare(2)  # no grow: nothing to prepare
        pool.prepare(4, warm=warm_note)  # a grow that never comes: its worker goes when the pool closes
    assert child_pids() == before
