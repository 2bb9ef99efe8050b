"""One phase of a step run pool by pool (``nereus_core.plan.phases``: generation; the forward passes;
the train stages), so that a phased plan's stages on disjoint slots run at once:

    one pool  -> its tasks called in the flow's thread, one after another (as every phase once ran)
    N pools   -> every pool's tasks submitted to the flow's task runner (Prefect's default
                 ThreadPoolTaskRunner: a thread per task), the tasks of one pool chained
                 (``wait_for``), the pools side by side; the phase ends when its last task does

Boundary: sequencing only. Which stages share slots is ``nereus_core.plan.pools``; the device pool
keeps calls on shared slots apart (``DevicePool._hold``: a call waits for those using its slots),
so a sync that reaches into another pool's slots waits for that pool's call and nothing deadlocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefect.futures import wait

from nereus_core.layout import Layout
from nereus_core.plan import Pool, pools

# False: every phase runs as one pool, one task after another (what a colocated plan does): a
# phased run's check against the same layouts run serially.
AT_ONCE = True


@dataclass(frozen=True)
class Ran:
    """One task call of a phase: what it returned, when it could start (``time.perf_counter``) and
    how long it took from there, seen from outside (Prefect's overhead included)."""

    result: Any
    start: float
    seconds: float


def pools_of(layouts: Mapping[str, Layout]) -> tuple[Pool, ...]:
    """The pools ``layouts`` (one phase's stages) run in: ``plan.pools``'s, or one of them all."""
    return pools(layouts) if AT_ONCE else (tuple(layouts),)


def run_pools(task: Any, calls: Sequence[Sequence[Mapping[str, Any]]]) -> list[list[Ran]]:
    """``task(**kwargs)`` for every kwargs of every pool in ``calls``; the results in that shape.
    One pool: called in this thread, in order. Several: submitted at once (a pool's calls chained),
    all awaited; the first failure is raised once every call has ended."""
    if len(calls) == 1:
        return [[_called(task, kwargs) for kwargs in calls[0]]]
    ends: dict[int, float] = {}
    lock = threading.Lock()

    def ended(i: int) -> Any:
        def done(_: Any) -> None:
            with lock:
                ends[i] = time.perf_counter()

        return done

    start, futures, flat = time.perf_counter(), [], []
    for pool in calls:
        chain: list[Any] = []
        for kwargs in pool:
            future = task.submit(**kwargs, wait_for=chain[-1:] or None)
            future.add_done_callback(ended(len(flat)))
            chain.append(future)
            flat.append(future)
        futures.append(chain)
    wait(flat)
    results = [f.result() for f in flat]  # raises the first failure
    out, i = [], 0
    for chain in futures:
        ran, begin = [], start
        for _ in chain:
            end = ends.get(i, time.perf_counter())
            ran.append(Ran(results[i], begin, end - begin))
            begin, i = end, i + 1
        out.append(ran)
    return out


def _called(task: Any, kwargs: Mapping[str, Any]) -> Ran:
    start = time.perf_counter()
    result = task(**kwargs)
    return Ran(result, start, time.perf_counter() - start)
