"""One phase of a step run slot group by slot group (``nereus_core.plan.phases``: generation; the
forward passes; the train stages), so that a phased plan's stages on disjoint slots run at once:

    one group  -> its tasks called in the flow's thread, one after another (as every phase once ran)
    N groups   -> every group's tasks submitted to the flow's task runner (Prefect's default
                  ThreadPoolTaskRunner: a thread per task), the tasks of one group chained
                  (``wait_for``), the groups side by side; the phase ends when its last task does

Boundary: sequencing only. Which stages share slots is ``nereus_core.plan.slot_groups``; the device
pool keeps calls on shared slots apart (``DevicePool._hold``: a call waits for those using its
slots), so a sync that reaches into another group's slots waits for that group's call and nothing
deadlocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefect.futures import wait

from nereus_core.layout import Layout
from nereus_core.plan import SlotGroup, slot_groups

# False: every phase runs as one slot group, one task after another (what a colocated plan does): a
# phased run's check against the same layouts run serially.
AT_ONCE = True


@dataclass(frozen=True)
class Ran:
    """One task call of a phase: what it returned, when it could start (``time.perf_counter``) and
    how long it took from there, seen from outside (Prefect's overhead included)."""

    result: Any
    start: float
    seconds: float


def slot_groups_of(layouts: Mapping[str, Layout]) -> tuple[SlotGroup, ...]:
    """The slot groups ``layouts`` (one phase's stages) run in: ``plan.slot_groups``'s, or one of
    them all."""
    return slot_groups(layouts) if AT_ONCE else (tuple(layouts),)


def run_slot_groups(task: Any, calls: Sequence[Sequence[Mapping[str, Any]]]) -> list[list[Ran]]:
    """``task(**kwargs)`` for every kwargs of every slot group in ``calls``; the results in that
    shape. One group: called in this thread, in order. Several: submitted at once (a group's calls
    chained), all awaited; the first failure is raised once every call has ended."""
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
    for group in calls:
        chain: list[Any] = []
        for kwargs in group:
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
