"""Tests of tasks/device_pool.py: real Dask workers forming a real gloo world."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cloudpickle
import psutil
import pytest
import torch
import torch.distributed as dist
from distributed import LocalCluster

from nereus_core.layout import Layout
from nereus_core.parallel.device import DeviceContext
from tasks.device_pool import DevicePool, DevicePoolError, DeviceRunError

# The per-rank helpers below travel to the workers by value: the workers need
# not be able to import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------- per-rank helpers


def world_sum(ctx: DeviceContext) -> tuple[int, int, float]:
    """(rank, world size, sum over ranks of rank + 1)."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return ctx.rank, dist.get_world_size(), t.item()


def tp_sum(ctx: DeviceContext, layout: Layout) -> tuple[tuple[int, ...], float]:
    """(this rank's TP group, sum of world ranks over that group)."""
    view = ctx.view(layout)
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t, group=view.tp_group)
    return view.tp_ranks, t.item()


def value_sum(ctx: DeviceContext, value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t)
    return t.item()


def echo(ctx: DeviceContext, a: Any, *, b: Any = None) -> tuple[int, Any, Any]:
    return ctx.rank, a, b


def keep(ctx: DeviceContext, key: str) -> None:
    ctx.resident[key] = torch.full((2,), float(ctx.rank))


def fail_on_odd(ctx: DeviceContext, word: str) -> int:
    if ctx.rank % 2:
        raise ValueError(f"{word} on rank {ctx.rank}")
    return ctx.rank


def _children() -> set[int]:
    """Child processes of the test process, except multiprocessing's resource tracker.

    The tracker is started once per interpreter by the first spawned process and
    lives until the interpreter exits; it is not a worker or a nanny.
    """
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _pids(pool: DevicePool) -> dict[str, int]:
    return {i["worker"]: i["pid"] for i in pool.info()}


# ------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def pool2() -> Iterator[DevicePool]:
    with DevicePool(2) as pool:
        yield pool


def test_world_forms_and_all_reduces(pool2: DevicePool) -> None:
    assert pool2.size == 2 and pool2.backend == "gloo"
    assert pool2.run_all(world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]
    infos = pool2.info()
    assert [i["rank"] for i in infos] == [0, 1]
    assert [i["worker"] for i in infos] == list(pool2.workers)
    assert len({i["pid"] for i in infos}) == 2
    events = [e for e, _ in pool2.timings]
    assert events[:2] == ["start", "world 2"]


def test_run_passes_per_rank_and_common_args(pool2: DevicePool) -> None:
    layout = Layout(tp=2, devices=(1, 0))
    out = pool2.run(layout, echo, [("x",), ("y",)], b=7)
    assert out == [(1, "x", 7), (0, "y", 7)]
    with pytest.raises(ValueError, match="per_rank_args has 1 entries for 2 devices"):
        pool2.run(layout, echo, [("x",)])
    with pytest.raises(ValueError, match=r"exceeds cluster\.devices=2"):
        pool2.run(Layout.contiguous(tp=4), echo)


def test_build_groups_and_tp_all_reduce(pool2: DevicePool) -> None:
    layout = Layout.contiguous(tp=2)
    pool2.build_groups(layout)
    assert layout.key in pool2.built_layouts
    assert pool2.run(layout, tp_sum, layout=layout) == [((0, 1), 1.0), ((0, 1), 1.0)]
    assert any(e == f"build_groups {layout.key}" for e, _ in pool2.timings)


def test_failing_fn_raises_with_remote_traceback(pool2: DevicePool) -> None:
    with pytest.raises(DeviceRunError) as info:
        pool2.run_all(fail_on_odd, word="kaboom")
    text = str(info.value)
    assert "failed on rank(s) [1]" in text
    assert "ValueError: kaboom on rank 1" in text
    assert "fail_on_odd" in text and "Traceback" in text
    assert info.value.failures[0].exc_type == "ValueError"
    # A failure outside a collective leaves the world usable.
    assert pool2.run_all(world_sum)[0] == (0, 2, 3.0)


def test_concurrent_callers_do_not_interleave_collectives(pool2: DevicePool) -> None:
    # Two driver threads (e.g. two Prefect tasks) issuing collectives on the same devices: without
    # the pool's per-device hold, rank 0 can pair one thread's all-reduce with the other's on rank 1.
    with ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(lambda v: [pool2.run_all(value_sum, value=v) for _ in range(10)], [1.0, 10.0]))
    assert outs == [[[2.0, 2.0]] * 10, [[20.0, 20.0]] * 10]


def test_grow_and_shrink_in_one_driver(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tasks.device_pool")
    before = _children()
    with DevicePool(2) as pool:
        pool.run_all(keep, key="shard")
        first = _pids(pool)

        pool.resize(4)
        assert pool.run_all(world_sum) == [(r, 4, 10.0) for r in range(4)]
        assert _pids(pool).items() >= first.items()  # survivors: same workers, same processes
        assert list(pool.workers[:2]) == list(first)  # ... and the same ranks
        infos = pool.info()
        assert [i["resident"] for i in infos] == [["shard"], ["shard"], [], []]
        layout = Layout.contiguous(tp=2, dp=2)
        pool.build_groups(layout)
        assert pool.run(layout, tp_sum, layout=layout) == [((0, 1), 1.0)] * 2 + [((2, 3), 5.0)] * 2

        pool.resize(2)
        assert pool.built_layouts == ()
        assert pool.run_all(world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]
        assert _pids(pool) == first
        assert len(_children() - before) == 2 * 2  # a nanny and a worker per device
        assert [e for e, _ in pool.timings if e.startswith("rebuild")] == ["rebuild 2->4", "rebuild 4->2"]
    assert _children() == before
    assert "resized 2 -> 4" in caplog.text


def test_external_scheduler_uses_its_workers() -> None:
    with LocalCluster(
        n_workers=3, threads_per_worker=1, dashboard_address=None, silence_logs=logging.ERROR
    ) as c:
        with DevicePool(2, scheduler_address=c.scheduler_address) as pool:
            assert pool.run_all(world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]
            pool.resize(3)
            assert pool.run_all(world_sum)[0] == (0, 3, 6.0)
        with pytest.raises(DevicePoolError, match=r"has 3 workers .* need 4 devices"):
            DevicePool(4, scheduler_address=c.scheduler_address, worker_timeout_s=0.5)
        assert len(c.scheduler_info["workers"]) == 3  # the pool did not stop workers it does not own


def test_unknown_scheduler_is_one_clear_error() -> None:
    with pytest.raises(
        DevicePoolError, match=r"cannot reach the Dask scheduler at tcp://127.0.0.1:9 within 1s"
    ):
        DevicePool(2, scheduler_address="tcp://127.0.0.1:9", connect_timeout_s=1)
