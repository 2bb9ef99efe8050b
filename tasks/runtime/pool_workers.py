"""The device pool's workers: their rank order, their hosts, and how to tell that one was lost or hung.

Boundary: ``WorkerBook`` records, for each worker the pool placed an actor on, its process id, its
nanny and its last measured memory (the resident bytes its heartbeats report, the model state the job
measured, the plan's prediction when the job gives it); ``lost`` answers which of a call's ranks have
a worker the scheduler no longer knows, each with one line naming the device slot, the worker, its
pid, the cause its nanny logged (killed by a signal, over its memory budget) and that memory;
``hung`` names, in one line, the ranks that did not answer a call by its deadline and why (a stopped
process, no heartbeat). It decides nothing: ``tasks.runtime.device_pool`` fails the call with it.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil  # a dependency of distributed

from tasks.runtime.cluster import DaskCluster, get_address_host, is_loopback

# A worker whose scheduler heartbeat (every 0.5 s for a pool under ten workers, Dask's rule) is older
# than this is not answering at all; one blocked in a collective with it still beats.
STALE_HEARTBEAT_S = 10.0

# How often ``lost`` asks the scheduler again while it waits for a broken worker to be dropped.
_SETTLE_POLL_S = 0.2


@dataclass(frozen=True)
class WorkerFacts:
    """What is known of one worker's process: its id, and its nanny's address (None: it has none)."""

    pid: int | None
    nanny: str | None


class WorkerBook:
    """The facts of each worker in the pool, and the lines that say how one was lost or hung."""

    def __init__(self) -> None:
        self._facts: dict[str, WorkerFacts] = {}
        self._rss: dict[str, tuple[int, float]] = {}  # resident bytes, time.monotonic() of the reading
        self._held: dict[str, int] = {}  # model state the job last measured on the slot
        self._predicted: dict[str, int] = {}  # the plan's bytes for the slot
        self._observed = float("-inf")

    def record(self, address: str, pid: int | None, nanny: str | None) -> None:
        self._facts[address] = WorkerFacts(pid, nanny)

    def forget(self, address: str) -> None:
        for book in (self._facts, self._rss, self._held, self._predicted):
            book.pop(address, None)

    def pid(self, address: str) -> int | None:
        return self._facts.get(address, WorkerFacts(None, None)).pid

    def note(self, address: str, *, held: int | None = None, predicted: int | None = None) -> None:
        """The slot's model state as the job measured it, and the plan's prediction for the slot."""
        if held is not None:
            self._held[address] = held
        if predicted is not None:
            self._predicted[address] = predicted

    def observe(
        self, cluster: DaskCluster, every_s: float = 0.0
    ) -> dict[str, tuple[int | None, float | None]] | None:
        """Each worker's heartbeat figures (``DaskCluster.worker_health``), its memory kept as the last
        measured. Asked at most every ``every_s`` (an empty answer in between); None when the
        scheduler does not answer."""
        now = time.monotonic()
        if now - self._observed < every_s:
            return {}
        self._observed = now
        try:
            health = cluster.worker_health()
        except (OSError, TimeoutError):
            return None
        for address, (rss, _) in health.items():
            if rss is not None and address in self._facts:
                self._rss[address] = (rss, now)
        return health

    def memory(self, address: str) -> str:
        """The worker's last measured memory and the plan's prediction for its slot, in a few words."""
        parts = []
        if address in self._rss:
            rss, when = self._rss[address]
            parts.append(f"{_mib(rss)} resident {time.monotonic() - when:.0f}s before")
        if address in self._held:
            parts.append(f"{_mib(self._held[address])} of model state at the last step")
        measured = ", ".join(parts) or "no measurement yet"
        predicted = self._predicted.get(address)
        plan = f"the plan predicts {_mib(predicted)}" if predicted is not None else "no plan prediction given"
        return f"last measured {measured}; {plan}"

    def lost(
        self, cluster: DaskCluster, workers: Sequence[str], ranks: Sequence[int], settle_s: float
    ) -> dict[int, str]:
        """Ranks whose workers the scheduler no longer knows, each with its line. ``settle_s``: how
        long to wait for the scheduler to drop them (after a call's connection broke)."""
        deadline = time.monotonic() + settle_s
        while True:
            health = self.observe(cluster)
            if health is None:  # the scheduler itself is gone: nothing to tell apart
                return {}
            gone = [r for r in ranks if r < len(workers) and workers[r] not in health]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(_SETTLE_POLL_S)
        out: dict[int, str] = {}
        for rank in gone:
            address = workers[rank]
            facts = self._facts.get(address, WorkerFacts(None, None))
            exit_line = cluster.worker_exit(facts.nanny, facts.pid)
            out[rank] = (
                f"device slot {rank} (worker {address}) was lost: {lost_cause(exit_line)}; "
                f"pid {facts.pid}, {self.memory(address)}"
            )
        return out

    def hung(
        self,
        cluster: DaskCluster,
        workers: Sequence[str],
        ranks: Sequence[int],
        *,
        call: str,
        label: str,
        deadline_s: float,
    ) -> str:
        """One line naming the ranks of ``call`` that gave no answer within ``deadline_s``: those whose
        process is stopped or sends no heartbeat first (the others wait on them in a collective)."""
        health = self.observe(cluster)
        why: dict[int, str] = {}
        for rank in ranks:
            address = workers[rank]
            state = process_state(address, self.pid(address))
            _, age = (health or {}).get(address, (None, None))
            if state == psutil.STATUS_STOPPED:
                why[rank] = "its process is stopped"
            elif health is not None and address not in health:
                why[rank] = "its worker left the scheduler"
            elif age is not None and age > STALE_HEARTBEAT_S:
                why[rank] = f"no heartbeat for {age:.0f}s"
        culprits = list(why) or list(ranks)
        named = "; ".join(
            f"device slot {r} (worker {workers[r]}, pid {self.pid(workers[r])}"
            f"{', ' + why[r] if r in why else ''})"
            for r in culprits
        )
        waiting = [r for r in ranks if r not in culprits]
        hint = (f"; slots {waiting} waited on it" if waiting else "") + (
            "" if why else "; every one still beats: a deadlocked kernel or collective?"
        )
        return (
            f"{label}: {named} gave no answer to {call.removesuffix(' for ' + label)} within its "
            f"{deadline_s:.0f}s deadline{hint}; "
            "raise cluster.call_timeout_s or call_timeout_s_per_token if the call is only slow; a resume "
            "starts new workers"
        )


def process_state(address: str, pid: int | None) -> str | None:
    """psutil's status of the worker process ``pid`` at ``address`` ('stopped', 'running', ...; 'gone'
    once it has exited) where it runs on this machine; None where it is not this machine's to see."""
    if pid is None or not is_loopback(get_address_host(address)):
        return None
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return "gone"


def kill_children(pids: Sequence[int]) -> list[int]:
    """SIGKILL the processes ``pids`` that are this process's children (the workers of a LocalCluster
    it started: a stopped or hung one ignores its nanny's polite stop); a reused pid is left alone."""
    killed = []
    for pid in pids:
        try:
            if psutil.Process(pid).ppid() != os.getpid():
                continue
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return killed


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def by_rank(workers: Sequence[str], figures: Mapping[int, int]) -> dict[str, int]:
    """``figures`` by rank, keyed by each rank's worker address instead."""
    return {workers[r]: v for r, v in figures.items() if 0 <= r < len(workers)}


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
