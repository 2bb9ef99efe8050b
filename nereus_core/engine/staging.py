"""A snapshot written in the background: pieces copied to host memory, then written by a thread.

PyTorch DCP's ``async_save`` does the same: the training loop is held up only while the state is
copied off the device ("staging"); the write to storage runs beside the next steps. Here every old
device of a model-stage copies the pieces ``durable_write`` would write (``staged_write``), hands
them to one writer thread of its own and returns; ``finish_staged`` later waits for that write and
returns its receipt for the driver to commit. The copy is the recovery point: whatever the live
state does meanwhile (a switch moving it, the next step training it), the write holds the step's.
A shard that is never written again (a live switch's kept source) needs no copy in host memory.

Boundary: device-side functions over one ``DeviceContext`` (its ``background`` holds the writes in
flight); the store is ``engine.reshard``'s ``StateStore`` Protocol.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from nereus_core.emu import SliceSpec
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.reshard import ReshardJob, StateStore, Wanted, old_state


def staged_write(
    ctx: DeviceContext,
    mine: Wanted,
    *,
    job: ReshardJob,
    store: StateStore,
    key: str,
    in_place: bool = False,
) -> dict[str, float]:
    """Copy this old device's assigned pieces (``mine``) to host memory and start writing them to
    ``store`` in the background under ``key``; returns the bytes staged and the copy's seconds.

    ``in_place``: the caller promises the shard is never written again (a live switch keeps it as
    its rollback source, then retires it: ``transition_schedule.staged_in_place``), so pieces
    already in host memory are written as they are, with no copy; the writer holds them until done."""
    if key in ctx.background:
        raise ValueError(f"device {ctx.rank}: a background write {key!r} is already in flight")
    start = time.perf_counter()
    source = old_state(ctx, job).pieces
    pieces = [
        (
            name,
            _host(source[(name, box)].detach(), copy=not in_place),
            SliceSpec(job.old_map.tensor(name).shape, box),
        )
        for name, box in mine
    ]
    staged = sum(t.numel() * t.element_size() for _, t, _ in pieces)
    seconds = time.perf_counter() - start
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nereus-write-{ctx.rank}")
    ctx.background[key] = writer.submit(_write_behind, store, ctx.rank, pieces)
    writer.shutdown(wait=False)  # the thread ends with its one write
    return {"staged": float(staged), "staging_s": seconds}


BACKGROUND_NICE = 19  # the lowest CPU priority: the job's own threads come first


def _write_behind(store: StateStore, rank: int, pieces: list) -> Any:
    """``store.write_pieces`` on this thread at the lowest CPU priority: where the devices are the
    host's cores (CPU workers), the moves and the next steps keep them, and the write takes what
    they leave (on two busy cores a write beside a switch's moves doubled the moves' seconds)."""
    with contextlib.suppress(OSError, AttributeError):  # not on every platform; the write goes on
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    return store.write_pieces(rank, pieces)


def _host(tensor: torch.Tensor, *, copy: bool) -> torch.Tensor:
    """``tensor`` in host memory: a copy unless ``copy`` is False and it is there already."""
    return tensor if tensor.device.type == "cpu" and not copy else tensor.to("cpu", copy=True)


def finish_staged(ctx: DeviceContext, *, key: str) -> Any:
    """Wait for the background write ``key`` and return its receipt (its error, if it failed)."""
    future = ctx.background.pop(key, None)
    if future is None:
        raise KeyError(f"device {ctx.rank}: no background write {key!r} (the worker was replaced?)")
    return future.result()


def drop_staged(ctx: DeviceContext, *, key: str) -> bool:
    """Forget the background write ``key`` once it ends, its receipt unused; True if there was one."""
    future = ctx.background.pop(key, None)
    if future is not None:
        future.cancel()
    return future is not None
