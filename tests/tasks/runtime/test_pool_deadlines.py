"""Tests of the device pool's bounded waits and worker memory (tasks/runtime/device_pool.py,
pool_workers.py): a stopped worker fails its call by the call's deadline in one
line naming it, a killed one is named with its model-stage and last measured memory, and a worker
past its memory limit is killed by its nanny and named as such."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import cloudpickle
import pytest
import torch

from nereus_core.config import ClusterConfig
from nereus_core.engine.device import DeviceContext
from tasks.runtime.call_work import call_label, call_tokens
from tasks.runtime.device_pool import (
    STATE_COPIES,
    DeviceHungError,
    DevicePool,
    DevicePoolError,
    DeviceRunError,
    worker_memory_limit,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the helpers travel to the workers by value

pytestmark = pytest.mark.timeout(240)


def worker_pid(ctx: DeviceContext) -> int:
    return os.getpid()


def rank_after(ctx: DeviceContext, seconds: float = 0.1, **_: object) -> int:
    time.sleep(seconds)
    return ctx.rank


def hold_bytes(ctx: DeviceContext, n: int, **_: object) -> int:
    ctx.resident["ballast"] = bytearray(n)  # touched: bytearray zero-fills every page
    time.sleep(60)
    return ctx.rank


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """``pid`` SIGSTOPped; whatever happens, continued (or killed) afterwards."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_stopped_worker_fails_the_call_by_its_deadline_naming_it_and_the_pool_closes() -> None:
    """Without a deadline the driver waited for the stopped worker until the scheduler dropped it
    (5 minutes) or for ever; now the call fails at its deadline in one line naming the slot, the
    worker, its pid, the model-stage and the deadline, a later call on it fails at once, and the pool
    still closes (the stopped worker, which ignores a polite stop, is killed)."""
    cluster = ClusterConfig(
        devices=2, memory_per_device="64MiB", call_timeout_s=6, call_timeout_s_per_token=0
    )
    pool = DevicePool.for_cluster(cluster)
    pid = 0
    try:
        assert pool.call_deadline_s(10_000) == 6.0
        (pid,) = pool.run_on([1], worker_pid)
        worker = pool.workers[1]
        with stopped(pid):
            start = time.monotonic()
            with pytest.raises(DeviceHungError) as info, pool.scope("actor/train"):
                pool.run_all(rank_after, seconds=0.1)
            elapsed = time.monotonic() - start
            line = str(info.value)
            assert 6.0 <= elapsed < 6.0 + 10, elapsed  # the gather polls every 2 s; a loaded machine
            assert "\n" not in line, line
            assert line.startswith(
                f"actor/train: device slot 1 (worker {worker}, pid {pid}, its process is stopped)"
            )
            assert "within its 6s deadline" in line and "raise cluster.call_timeout_s" in line, line
            assert [f.rank for f in info.value.failures] == [1]  # rank 0 answered
            start = time.monotonic()
            with pytest.raises(DeviceHungError, match=r"slot\(s\) \[1\] gave no answer to an earlier call"):
                pool.run_all(rank_after, seconds=0.1)
            assert time.monotonic() - start < 1.0
            start = time.monotonic()
            pool.close()
            assert time.monotonic() - start < 60
    finally:
        pool.close()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_worker_is_named_with_its_model_stage_pid_and_last_measured_memory() -> None:
    """SIGKILL (what the kernel's OOM killer sends) during a call of actor/train: one line naming
    the slot, the model-stage, the pid, the resident memory its heartbeats reported and the model
    state the job measured on it."""
    with DevicePool(2) as pool:
        (pid,) = pool.run_on([1], worker_pid)
        worker = pool.workers[1]
        pool.note_memory({0: 3 * 2**20, 1: 5 * 2**20})
        time.sleep(2.5)  # a heartbeat has reported the worker's memory
        threading.Timer(3.0, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.raises(DeviceRunError) as info:
            pool.run_all(rank_after, [(0.1,), (30.0,)], name="actor/train")
        line = str(info.value)
        assert "\n" not in line, line
        assert "for actor/train failed on rank(s) [1]" in line, line
        assert f"device slot 1 (worker {worker}) was lost: " in line and f"pid {pid}, " in line, line
        assert " MiB resident " in line and "5 MiB of model state at the last step" in line, line
        assert "no plan prediction given" in line, line


def test_a_cpu_worker_past_its_memory_limit_is_killed_by_its_nanny_and_named() -> None:
    """The limit (here 700 MiB: a fresh worker holds ~260 MiB) is Dask's nanny's; the call fails
    naming the worker as over its memory budget, not merely 'lost'."""
    with DevicePool(1, memory_limit=700 * 2**20) as pool:
        with pytest.raises(DeviceRunError) as info:
            pool.run_all(hold_bytes, n=800 * 2**20, name="actor/train")
        line = str(info.value)
        assert "\n" not in line, line
        assert "killed by its nanny, over its memory budget (out of memory)" in line, line
        assert "device slot 0 " in line and "for actor/train" in line, line


def test_the_worker_memory_limit_allows_for_the_process_beside_the_slot() -> None:
    cpu = ClusterConfig(memory_per_device="64MiB", backend="gloo")
    assert worker_memory_limit(cpu) == STATE_COPIES * 64 * 2**20 + 4 * 2**30
    assert worker_memory_limit(cpu.model_copy(update={"worker_memory_overhead": 0})) is None
    assert worker_memory_limit(cpu.model_copy(update={"backend": "nccl"})) is None
    remote = cpu.model_copy(update={"scheduler_address": "tcp://127.0.0.1:8786"})
    assert worker_memory_limit(remote) is None


def test_a_call_s_deadline_scales_with_its_tokens_and_names_its_model_stage() -> None:
    batch = {
        "ids": torch.zeros(4, 8, dtype=torch.long),
        "adv": torch.zeros(4, 8),
        "n": [torch.ones(3, dtype=torch.bool)],
    }
    assert call_tokens(batch.values()) == 32 + 3  # weights and float statistics do not count
    assert call_tokens([{"w": torch.zeros(1000)}]) == 0
    assert call_label({"name": "critic/infer"}) == "critic/infer"
    job = type("Job", (), {"name": "actor/train"})()
    assert call_label({"job": job}) == "actor/train" and call_label({}) == ""


def test_the_scheduler_connection_has_the_configured_deadline() -> None:
    """``cluster.connect_timeout_s`` reaches the client: nothing listens on port 9, and the pool
    gives up after the configured second with one line naming the address and the deadline."""
    cluster = ClusterConfig(scheduler_address="tcp://127.0.0.1:9", connect_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(
        DevicePoolError, match=r"^cannot reach the Dask scheduler at tcp://127.0.0.1:9 within 1s"
    ):
        DevicePool.for_cluster(cluster)
    assert time.monotonic() - start < 15


def test_a_lost_worker_s_memory_line_gives_the_plan_s_prediction_beside_what_was_measured() -> None:
    from tasks.runtime.pool_workers import WorkerBook

    book = WorkerBook()
    book.record("tcp://w0", 123, None)
    assert "no plan prediction given" in book.memory("tcp://w0")
    book.note("tcp://w0", held=3 * 2**20, predicted=5 * 2**20)
    line = book.memory("tcp://w0")
    assert "3 MiB of model state" in line and "the plan predicts 5 MiB" in line, line
