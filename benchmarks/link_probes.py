"""What the CPU device pool's links can do, in plain gloo with no Nereus code: the benchmarks'
yardsticks (``bench_reshard.py``, ``bench_weight_sync.py``).

    p2p_probe      one pair's point-to-point bandwidth
    pattern_probe  a reshard plan's bytes per device pair moved at once as warm buffers (and its
                   same-device bytes copied meanwhile): the physical limit of that plan here
    plan_traffic   a plan's bytes per device pair and per device copied locally
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from nereus_core.emu import ReshardPlan
from nereus_core.engine.device import DeviceContext

WAIT = timedelta(seconds=300)


def p2p_probe(ctx: DeviceContext, src: int, dst: int, nbytes: int, repeats: int = 3) -> float | None:
    """``src`` sends ``nbytes`` to ``dst`` (which acknowledges); ``dst`` returns bytes/s (the median;
    the first round warms the connection up), ``src`` None."""
    buf = torch.ones(max(nbytes // 4, 1))
    ack = torch.zeros(1)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        if ctx.rank == src:
            dist.isend(buf, dst, tag=900 + i).wait(WAIT)
            dist.irecv(ack, dst, tag=950 + i).wait(WAIT)
        else:
            dist.irecv(buf, src, tag=900 + i).wait(WAIT)
            dist.isend(ack, src, tag=950 + i).wait(WAIT)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) if ctx.rank == dst else None


def plan_traffic(plan: ReshardPlan) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
    """``plan``'s bytes per ``(src, dst)`` device pair, and its same-device bytes per device."""
    pairs: dict[tuple[int, int], int] = defaultdict(int)
    for t in plan.transfers:
        pairs[(t.src, t.dst)] += t.nbytes
    local: dict[int, int] = defaultdict(int)
    for t in plan.local:
        local[t.dst] += t.nbytes
    return dict(pairs), dict(local)


def pattern_probe(
    ctx: DeviceContext, pairs: dict[tuple[int, int], int], local: dict[int, int], repeats: int = 5
) -> float:
    """``pairs``' bytes moved at once as plain gloo messages, one warm contiguous buffer per pair,
    receives posted first, with this device's ``local`` bytes copied meanwhile; this device's median
    seconds (the first round warms the pairs up). Run on every device of the pairs; the slowest
    device's figure is what this machine can do for that pattern, with none of Nereus's work in it."""
    recvs = {src: torch.empty(n // 4) for (src, dst), n in pairs.items() if dst == ctx.rank}
    sends = {dst: torch.ones(n // 4) for (src, dst), n in pairs.items() if src == ctx.rank}
    copy = [torch.ones(local.get(ctx.rank, 0) // 4), torch.empty(local.get(ctx.rank, 0) // 4)]
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        works = [dist.irecv(buf, src, tag=700 + i) for src, buf in recvs.items()]
        works += [dist.isend(buf, dst, tag=700 + i) for dst, buf in sends.items()]
        copy[1].copy_(copy[0])
        for work in works:
            work.wait(WAIT)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
