"""Run a function on every rank of a fresh gloo world of spawned processes (for multi-process tests).

``run_world(n, fn, *args)`` starts ``n`` fresh processes, joins them into one gloo world
on a free local port, calls ``fn(rank, world_size, *args)`` on each and returns the
results in rank order. ``fn`` must be a top-level (picklable) function; results go
back through ``torch.save``, so tensors, dicts and lists of them are fine. If any
rank raises, ``run_world`` raises ``WorldError`` carrying that rank's traceback.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tasks.runtime.cluster import worker_processes


class WorldError(RuntimeError):
    """A rank of a test world failed or the world timed out."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    results: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, _to_bytes(value)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    # Skip the interpreter's teardown of torch (seconds per rank); only the result must get out.
    results.close()
    results.join_thread()
    os._exit(0)


def run_world(
    n: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, start_method: str = "forkserver"
) -> list[Any]:
    """``[fn(rank, n, *args) for rank in range(n)]``, each on its own process in one gloo world."""
    # The pool's fork server (one per process) imports torch once; every later world forks from it in
    # milliseconds instead of each rank importing torch (seconds). It never runs torch ops.
    ctx = worker_processes() if start_method == "forkserver" else mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, n, port, timeout_s, results, fn, args), daemon=True)
        for rank in range(n)
    ]
    for proc in procs:
        proc.start()
    done = False
    try:
        values = _collect(n, results, procs, timeout_s)
        done = True
        return values
    finally:
        _stop(procs, graceful=done)


def _stop(procs: list[Any], *, graceful: bool) -> None:
    """Join the ranks; after a failure the others may block in a collective, so terminate them."""
    for proc in procs:
        if graceful:
            proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)


def _collect(n: int, results: Any, procs: list[Any], timeout_s: float) -> list[Any]:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) < n:
        try:
            rank, ok, payload = results.get(timeout=1.0)
        except queue.Empty:
            crashed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in values]
            if crashed:
                raise WorldError(
                    f"rank {crashed[0]} of {n} died (exit code {procs[crashed[0]].exitcode})"
                ) from None
            if time.monotonic() > deadline:
                raise WorldError(
                    f"world of {n} timed out after {timeout_s}s; ranks done: {sorted(values)}"
                ) from None
            continue
        if not ok:
            raise WorldError(f"rank {rank} of {n} failed:\n{payload}")
        values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [values[rank] for rank in range(n)]
