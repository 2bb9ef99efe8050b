"""Workers for the device pool: placing actors on them, and preparing a grow ahead of time.

Boundary: ``place_actors`` puts one ``DeviceActor`` on each of some workers (their import path
checked first); ``free_workers`` waits for the workers a pool of ``devices`` still lacks.
``Growth`` does both in a background thread for a grow that has not happened yet: it
starts the extra workers, places their actors and runs ``warm`` on them in a torch.distributed
world of their own (the new workers only, left again at the end), while the pool's own world keeps
running steps. ``tasks.runtime.device_pool.DevicePool.resize`` then only forms the new world with the
prepared actors. Nothing here decides when to grow: the job flow does.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from nereus_core import faults
from tasks.runtime.cluster import ClusterError, DaskCluster, Future, get_address_host
from tasks.runtime.device_actor import DeviceActor, DevicePoolError, gather, issue
from tasks.runtime.pool_workers import local_ranks, order_key

logger = logging.getLogger(__name__)

# A function run on each prepared device with its context, in the new workers' own world.
Warm = Callable[[Any], Any]


@dataclass(frozen=True)
class PlacedActor:
    """A device actor on a worker, not yet in any world: what the pool records of it."""

    address: str
    key: str
    future: Future
    pid: int | None
    nanny: str | None


def place_actors(cluster: DaskCluster, addresses: list[str], timeout_s: float) -> list[PlacedActor]:
    """One DeviceActor pinned to each address, once the worker's import path is checked (an actor
    unpickled with the wrong packages would fail much later), in the order of ``addresses``."""
    try:
        pids = cluster.guard_imports(addresses, timeout_s)
    except ClusterError as exc:
        raise DevicePoolError(str(exc)) from None
    nannies = cluster.nannies()
    futures = {
        a: cluster.client.submit(
            DeviceActor,
            a,
            faults.armed_points(),
            key=f"nereus-device-actor-{uuid.uuid4().hex}",
            actor=True,
            workers=[a],
            allow_other_workers=False,
        )
        for a in addresses
    }
    placed = []
    for a, fut in futures.items():
        try:
            fut.result(timeout=timeout_s)
        except Exception as exc:  # the worker could not import or build the actor, or is gone
            raise DevicePoolError(
                f"the device actor could not start on worker {a} within {timeout_s:g}s: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        placed.append(PlacedActor(a, str(fut.key), fut, pids.get(a), nannies.get(a)))
    return placed


def free_workers(
    cluster: DaskCluster,
    taken: Collection[str],
    devices: int,
    need: int,
    timeout_s: float,
    stop: threading.Event | None = None,
) -> list[str]:
    """Addresses of ``need`` workers outside ``taken``, in a stable order, once the cluster has them
    (the caller has asked a cluster of ours for ``devices`` workers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        names = cluster.worker_names()
        free = sorted((a for a in names if a not in taken), key=lambda a: order_key(names[a], a))
        if len(free) >= need:
            return free[:need]
        if stop is not None and stop.is_set():
            raise DevicePoolError("the pool closed while workers for a grow were starting")
        if time.monotonic() > deadline:
            where = cluster.scheduler_address or "the local cluster"
            fix = (
                f"start {need - len(free)} more (dask worker {where} --nthreads 1) or lower the devices"
                if cluster.scheduler_address
                else "see the workers' log"
            )
            raise DevicePoolError(
                f"{where} has {len(names)} workers ({len(free)} free) after {timeout_s:g}s; "
                f"need {devices} devices: {fix}"
            )
        time.sleep(0.1)


class Growth:
    """Workers for a pool of ``devices``, started and warmed in a background thread.

    ``workers``: the pool's workers now, in rank order. ``join``: the pool's options of
    ``DeviceActor.join`` (backend, timeout, torch threads), for the new workers' own world; ``warm``
    (None: none) runs on each of them there.
    """

    def __init__(
        self,
        cluster: DaskCluster,
        *,
        devices: int,
        workers: Sequence[str],
        join: dict[str, Any],
        warm: Warm | None,
        worker_timeout_s: float,
        join_timeout_s: float,
        grace_s: float,
    ) -> None:
        self.devices = devices
        self.seconds: float | None = None  # how long the preparation took, once done
        self.warmed = False
        self.placed: list[PlacedActor] = []
        self._cluster = cluster
        self._workers = list(workers)
        self._join = join
        self._warm = warm
        self._timeouts = (worker_timeout_s, join_timeout_s, grace_s)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        cluster.scale(devices)  # here, in the caller's thread: the cluster object is not ours to share
        self._thread = threading.Thread(target=self._run, name=f"nereus-grow-to-{devices}", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """Whether the preparation finished and every placed worker is warm (without waiting)."""
        return not self._thread.is_alive() and self._error is None and (self.warmed or self._warm is None)

    def result(self, stop: bool = False) -> list[PlacedActor]:
        """Wait for the preparation (``stop``: give up waiting for workers not there yet) and return
        the actors placed; raise what stopped it, with the placed ones still in ``placed``."""
        if stop:
            self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.placed

    def _run(self) -> None:
        start = time.perf_counter()
        worker_timeout_s, _, _ = self._timeouts
        try:
            addresses = free_workers(
                self._cluster,
                set(self._workers),
                self.devices,
                self.devices - len(self._workers),
                worker_timeout_s,
                self._stop,
            )
            self.placed = place_actors(self._cluster, addresses, worker_timeout_s)
            if self._warm is not None and self.placed:
                self._warm_in_own_world(self._warm)
                self.warmed = True
        except BaseException as exc:  # handed to whoever waits for it
            self._error = exc
        self.seconds = time.perf_counter() - start
        logger.info("device pool: %d workers prepared in %.2fs", len(self.placed), self.seconds)

    def _warm_in_own_world(self, warm: Warm) -> None:
        """The placed actors join a world of their own, run ``warm`` there, and leave it."""
        _, join_timeout_s, grace_s = self._timeouts
        workers = [p.address for p in self.placed]

        def call(rank: int, method: str, *args: Any, **kwargs: Any) -> tuple[int, Any]:
            p = self.placed[rank]
            return rank, issue(lambda: self._cluster.call_actor(p.address, p.key, method, *args, **kwargs))

        def run(what: str, calls: list[tuple[int, Any]]) -> list[Any]:
            return gather(
                f"{what} (preparing a grow)", calls, workers, timeout_s=join_timeout_s, grace_s=grace_s
            )

        n, host = len(workers), get_address_host(workers[0])
        # Each device as it will be in the grown world (NCCL picks the GPU by the local rank).
        local = local_ranks([*self._workers, *workers])[len(self._workers) :]
        port = run("open_rendezvous", [call(0, "open_rendezvous")])[0]
        joins = [call(r, "join", r, n, host, port, local_rank=local[r], **self._join) for r in range(n)]
        run("join", joins)
        try:
            run("warm", [call(r, "run", warm) for r in range(n)])
        finally:
            run("leave", [call(r, "leave") for r in range(n)])
