"""The device pool's workers: their rank order, their hosts, and how to tell that one was lost.

Boundary: ``WorkerBook`` records, for each worker the pool placed an actor on, its process id and
its nanny; ``lost`` answers which of a call's ranks have a worker the scheduler no longer knows,
each with one line naming the device slot, the worker and the cause its nanny logged (killed by a
signal, over its memory budget). It decides nothing: ``tasks.runtime.device_pool`` fails the call with it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tasks.runtime.cluster import DaskCluster, get_address_host

# How often ``lost`` asks the scheduler again while it waits for a broken worker to be dropped.
_SETTLE_POLL_S = 0.2


@dataclass(frozen=True)
class WorkerFacts:
    """What is known of one worker's process: its id, and its nanny's address (None: it has none)."""

    pid: int | None
    nanny: str | None


class WorkerBook:
    """The facts of each worker in the pool, and the lines that say how one was lost."""

    def __init__(self) -> None:
        self._facts: dict[str, WorkerFacts] = {}

    def record(self, address: str, pid: int | None, nanny: str | None) -> None:
        self._facts[address] = WorkerFacts(pid, nanny)

    def forget(self, address: str) -> None:
        self._facts.pop(address, None)

    def lost(
        self, cluster: DaskCluster, workers: Sequence[str], ranks: Sequence[int], settle_s: float
    ) -> dict[int, str]:
        """Ranks whose workers the scheduler no longer knows, each with its line. ``settle_s``: how
        long to wait for the scheduler to drop them (after a call's connection broke)."""
        deadline = time.monotonic() + settle_s
        while True:
            try:
                present = set(cluster.worker_names())
            except (OSError, TimeoutError):  # the scheduler itself is gone: nothing to tell apart
                return {}
            gone = [r for r in ranks if r < len(workers) and workers[r] not in present]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(_SETTLE_POLL_S)
        out: dict[int, str] = {}
        for rank in gone:
            address = workers[rank]
            facts = self._facts.get(address, WorkerFacts(None, None))
            exit_line = cluster.worker_exit(facts.nanny, facts.pid)
            out[rank] = f"device slot {rank} (worker {address}) was lost: {lost_cause(exit_line)}"
        return out


def lost_cause(exit_line: str | None) -> str:
    """The cause of a worker's loss in a few words, from what its nanny logged (None: nothing)."""
    if exit_line is None:
        return (
            "its process died or stopped answering (killed, out of memory? its nanny logged no cause; "
            "see the worker's log)"
        )
    if "memory budget" in exit_line:
        return f"killed by its nanny, over its memory budget (out of memory): {exit_line}"
    signal = re.search(r"killed by signal (\d+)", exit_line)
    if signal is not None and signal.group(1) == "9":
        return f"killed (out of memory? the kernel's OOM killer sends signal 9): {exit_line}"
    return exit_line


def order_key(name: Any, address: str) -> tuple[int, int, str, str]:
    """Integer names first, numerically (LocalCluster's 0, 1, ...), then the rest by name and address."""
    if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
        return (0, int(name), "", address)
    return (1, 0, str(name), address)


def local_ranks(addresses: list[str]) -> list[int]:
    """Position of each worker among the pool's workers on the same host (selects its GPU)."""
    seen: dict[str, int] = {}
    out: list[int] = []
    for a in addresses:
        host = get_address_host(a)
        out.append(seen.get(host, 0))
        seen[host] = out[-1] + 1
    return out


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Whether ``predicate`` became true within ``timeout_s`` (polled every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
