"""Which workers are the device pool's: joining (at start, by a resize, or prepared ahead) and leaving.

Boundary: the membership half of ``tasks.runtime.device_pool.DevicePool`` (a base class it extends): the
rank order of worker addresses, their actors, a grow prepared in the background
(``tasks.runtime.pool_growth.Growth``) and the workers a shrink let go. The world over the members and
the calls to them are ``device_pool``'s. A grow is prepared while the job runs
(``prepare``; ``ready_devices`` says when it is warm); a shrink forms the smaller world at once and
retires the workers that left only afterwards (``retire_left``), so that the switch's pause holds
no worker shutdown. Nothing here decides when to grow or shrink: the job flow does.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import torch

from nereus_core.config import ClusterConfig
from tasks.runtime.cluster import Client, ClusterError, DaskCluster, Future, TlsFiles
from tasks.runtime.device_actor import DevicePoolError
from tasks.runtime.pool_growth import Growth, PlacedActor, Warm, free_workers, place_actors
from tasks.runtime.pool_workers import WorkerBook, wait_until

logger = logging.getLogger(__name__)

# How many copies of a slot's state a CPU worker may hold at once: the state itself, and a staged
# checkpoint or the source shards a live move keeps until its targets are verified.
STATE_COPIES = 2


def worker_memory_limit(cluster: ClusterConfig) -> int | None:
    """Bytes each worker process of a LocalCluster may hold before its nanny kills it (and the call
    names it as lost), or None for no limit. Only for CPU workers: there the slot's capacity
    (``memory_per_device``) is host memory, and the process holds Python, torch and DeepSpeed beside
    it (``worker_memory_overhead``). A CUDA slot's capacity is the GPU's, which CUDA enforces itself
    (an out-of-memory error in the call, with its traceback), and the host memory of a CUDA worker
    (its CUDA context, pinned buffers, staged checkpoints) has no relation to it; a remote
    scheduler's workers are its operator's to limit (``dask worker --memory-limit``)."""
    overhead = int(cluster.worker_memory_overhead)
    if cluster.scheduler_address is not None or overhead == 0 or cluster.backend == "nccl":
        return None
    if cluster.backend == "auto" and torch.cuda.is_available():
        return None
    return STATE_COPIES * int(cluster.memory_per_device) + overhead


class PoolMembers:
    """The workers of a device pool in rank order, and those joining or leaving it."""

    scheduler_address: str | None
    tls: TlsFiles | None
    backend: str | None
    connect_timeout_s: float
    worker_timeout_s: float
    join_timeout_s: float
    torch_threads: int | None
    failure_grace_s: float
    memory_limit: int | None
    timings: list[tuple[str, float]]

    def _init_members(self) -> None:
        self._cluster: DaskCluster | None = None
        self._workers: list[str] = []  # addresses in rank order
        self._actors: dict[str, str] = {}  # address -> the key of its actor
        self._futures: dict[str, Future] = {}  # address -> the actor's future (keeps it alive)
        self._book = WorkerBook()  # each worker's pid and nanny, to tell how one was lost
        self._growth: Growth | None = None  # workers being prepared for a coming grow
        self._cold: tuple[int, ...] = ()  # ranks the last resize added without preparing them
        self._leaving: list[str] = []  # workers a shrink let go, to retire after the switch
        self._stuck: set[str] = set()  # workers that gave no answer to a call by its deadline
        self._gone: set[str] = set()  # workers lost during a call

    @property
    def size(self) -> int:
        """Number of devices (world size)."""
        return len(self._workers)

    @property
    def workers(self) -> tuple[str, ...]:
        """Worker addresses in rank order."""
        return tuple(self._workers)

    @property
    def cold_ranks(self) -> tuple[int, ...]:
        """Ranks the last ``resize`` added without ``prepare`` (their ``warm`` has not run)."""
        return self._cold

    @property
    def ready_devices(self) -> int:
        """Slots a resize could form now without starting or warming a worker: the pool's, plus a
        prepared grow's once its workers are placed and warmed (never waits)."""
        growth = self._growth
        return self.size + (len(growth.placed) if growth is not None and growth.ready else 0)

    def reported_devices(self) -> int:
        """Slots the scheduler could give the pool now: its workers and every other worker it reports."""
        others = set(self._cluster_().worker_names()) - set(self._actors) - set(self._leaving)
        return self.size + len(others)

    def prepare(self, devices: int, warm: Warm | None = None) -> None:
        """Start, in the background, the workers a later ``resize(devices)`` adds, with their actors,
        and run ``warm(ctx)`` on them in a world of their own; the pool's world keeps running
        meanwhile (``tasks.runtime.pool_growth``). No grow, or one already being prepared: nothing."""
        if devices <= self.size or self._growth is not None:
            return
        self.retire_left()  # the cluster scales to the grow: no worker of ours may still be leaving
        opts = {
            "backend": self.backend,
            "timeout_s": self.join_timeout_s,
            "torch_threads": self.torch_threads,
        }
        self._growth = Growth(
            self._cluster_(),
            devices=devices,
            workers=self._workers,
            join=opts,
            warm=warm,
            worker_timeout_s=self.worker_timeout_s,
            join_timeout_s=self.join_timeout_s,
            grace_s=self.failure_grace_s,
        )

    def retire_left(self) -> float:
        """Retire the workers a shrink let go (ours only: an external scheduler's keep running);
        returns seconds. The job calls it once the switch that no longer uses them committed."""
        leaving, self._leaving = self._leaving, []
        if not leaving or not self._cluster_().owns_workers:
            return 0.0
        start = time.perf_counter()
        # Collect any future left in a reference cycle, so that the actors' keys are released
        # and the scheduler forgets the actors before their workers retire.
        gc.collect()
        wait_until(lambda: not any(self._client_().has_what(workers=leaving).values()), 10.0)
        names = self._cluster_().worker_names()
        self._cluster_().retire([names.get(a) for a in leaving])
        if not wait_until(
            lambda: not set(leaving) & set(self._cluster_().worker_names()), self.worker_timeout_s
        ):
            raise DevicePoolError(f"workers {leaving} did not shut down within {self.worker_timeout_s:g}s")
        seconds = time.perf_counter() - start
        self.timings.append((f"retire {len(leaving)}", seconds))
        logger.info("device pool: %d workers retired in %.3fs", len(leaving), seconds)
        return seconds

    # ---------------------------------------------------------------- joining and leaving

    def _connect(self, devices: int) -> None:
        try:
            self._cluster = DaskCluster(
                devices,
                self.scheduler_address,
                tls=self.tls,
                connect_timeout_s=self.connect_timeout_s,
                memory_limit=self.memory_limit,
            )
        except ClusterError as exc:
            raise DevicePoolError(str(exc)) from None

    def _acquire(self, devices: int) -> list[str]:
        """Addresses of ``devices - size`` workers not yet in the pool, in a stable order."""
        self._cluster_().scale(devices + len(self._leaving))  # leaving workers still count until retired
        taken = set(self._actors) | set(self._leaving)
        return free_workers(self._cluster_(), taken, devices, devices - self.size, self.worker_timeout_s)

    def _place(self, addresses: list[str]) -> None:
        """One DeviceActor on each address (``pool_growth.place_actors``), appended to the rank order."""
        for placed in place_actors(self._cluster_(), addresses, self.worker_timeout_s):
            self._add(placed)

    def _add(self, placed: PlacedActor) -> None:
        a = placed.address
        self._actors[a] = placed.key
        self._futures[a] = placed.future
        self._book.record(a, placed.pid, placed.nanny)
        self._workers.append(a)

    def _adopt_prepared(self, stop: bool = False) -> list[str]:
        """Append the actors ``prepare`` placed to the rank order, once it is done (``stop``: without
        waiting for workers not there yet); returns those not warmed. A failed preparation is logged
        and what it placed is adopted: a resize then starts any missing workers itself."""
        growth, self._growth = self._growth, None
        if growth is None:
            return []
        try:
            placed = growth.result(stop=stop)
        except Exception as exc:
            logger.warning(
                "device pool: preparing %d devices failed: %s", growth.devices, str(exc).splitlines()[0]
            )
            placed = growth.placed
        for p in placed:
            self._add(p)
        self.timings.append((f"prepare {growth.devices}", growth.seconds or 0.0))
        return [] if growth.warmed else [p.address for p in placed]

    def _let_go(self, addresses: list[str]) -> None:
        """Drop the actors on ``addresses`` (they have left the world); their workers retire later."""
        for a in addresses:
            self._forget(a)
        self._leaving += addresses

    def _prune_lost(self) -> None:
        """Forget workers that left the scheduler (lost or stopped by someone else)."""
        present = self._cluster_().worker_names()
        self._leaving = [a for a in self._leaving if a in present]
        for a in [a for a in self._workers if a not in present]:
            logger.warning("device pool: worker %s is gone; its rank is dropped", a)
            self._forget(a)

    def _forget(self, address: str) -> None:
        """Drop the worker at ``address`` from the rank order, with its actor and what is known of it."""
        self._workers.remove(address)
        self._stuck.discard(address)
        self._gone.discard(address)
        self._actors.pop(address, None)
        self._futures.pop(address, None)
        self._book.forget(address)

    def _cluster_(self) -> DaskCluster:
        if self._cluster is None:
            raise DevicePoolError("the device pool is closed")
        return self._cluster

    def _client_(self) -> Client:
        return self._cluster_().client

    def _worker_names(self) -> dict[str, Any]:
        return self._cluster_().worker_names()
