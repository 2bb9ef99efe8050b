"""What the device pool tests share: calls that run on each rank, and the processes a pool starts."""

from __future__ import annotations

import os
import sys

import cloudpickle
import psutil
import torch
import torch.distributed as dist

from nereus_core.engine.device import DeviceContext
from nereus_core.layout import Layout
from tasks.runtime.device_pool import DevicePool

# The per-rank helpers travel to the workers by value: the workers need not import the tests.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


def keep(ctx: DeviceContext, key: str) -> None:
    ctx.resident[key] = torch.full((2,), float(ctx.rank))


def child_pids() -> set[int]:
    """Child processes of the test process, except multiprocessing's resource tracker and fork server.

    Each is started once per interpreter, by the first worker process started, and lives until the
    interpreter exits; neither is a worker or a nanny (the workers the server forked are counted).
    """
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
            server = "forkserver import main" in line and p.ppid() == os.getpid()  # not what it forked
            if "resource_tracker" not in line and not server:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def worker_pids(pool: DevicePool) -> dict[str, int]:
    return {i["worker"]: i["pid"] for i in pool.info()}


def warm_note(ctx: DeviceContext) -> None:
    """A warm-up that leaves a mark: its rank and world, and that world's sum of rank + 1."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ctx.resident["warmed"] = (ctx.rank, ctx.world_size, t.item())
