"""The device pool: Dask workers as device slots, joined in one torch.distributed world.

Boundary: the pool owns a ``tasks.runtime.cluster.DaskCluster`` (a LocalCluster on loopback,
or a client of an existing scheduler), places one ``DeviceActor`` on each worker it
uses, arms on it the fault points armed in the driver, and forms the
torch.distributed world over them. It dispatches calls to the actors and
gathers results; it never decides what runs where (the engine in nereus_core
passes top-level functions, the pool runs them on a layout's devices).

World rank = position in the pool's worker order. That order is stable: at
start the workers are sorted by name (LocalCluster names them 0, 1, ...), a
grow appends the new workers, a shrink removes the highest ranks, so a
surviving worker keeps its rank and its actor keeps its resident objects.
Every change of the device set rebuilds the world (all actors leave, all join
a fresh rendezvous); the layouts' groups die with it and callers rebuild them.
The rendezvous store listens on rank 0's own worker address only (loopback for a
local cluster), on a socket that rank 0's actor opens before anyone joins.

No wait is unbounded: before an actor is placed, its worker's import path is
checked (``DaskCluster.guard_imports``); calls go through ``DaskCluster.call_actor``, whose
futures always resolve; and while the driver waits on a call, the ranks' workers are polled,
so that a lost one fails the call with its cause (``tasks.runtime.pool_workers``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from nereus_core.config import ClusterConfig
from nereus_core.layout import Layout
from tasks.runtime.cluster import TlsFiles, get_address_host
from tasks.runtime.device_actor import DevicePoolError, DeviceRunError, RankFailure, gather, issue
from tasks.runtime.pool_members import PoolMembers
from tasks.runtime.pool_workers import local_ranks

__all__ = ["DevicePool", "DevicePoolError", "DeviceRunError", "RankFailure"]

logger = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "gloo", "nccl")


class DevicePool(PoolMembers):
    """``devices`` device actors over Dask workers, joined in one torch.distributed world."""

    def __init__(
        self,
        devices: int,
        scheduler_address: str | None = None,
        backend: str = "auto",
        *,
        connect_timeout_s: float = 10.0,
        worker_timeout_s: float = 120.0,
        join_timeout_s: float = 180.0,
        collective_timeout_s: float = 300.0,
        torch_threads: int | None = 1,
        failure_grace_s: float = 30.0,
        tls: TlsFiles | None = None,
    ) -> None:
        if devices < 1:
            raise ValueError(f"devices={devices}; a pool needs at least 1 device")
        if backend not in BACKEND_CHOICES:
            raise ValueError(f"backend={backend!r}; choose one of {BACKEND_CHOICES}")
        self.scheduler_address = scheduler_address
        self.tls = tls
        self.requested_backend = backend
        self.backend: str | None = None
        self.connect_timeout_s = connect_timeout_s
        self.worker_timeout_s = worker_timeout_s
        self.join_timeout_s = join_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.torch_threads = torch_threads
        self.failure_grace_s = failure_grace_s
        self.timings: list[tuple[str, float]] = []
        self.rendezvous: tuple[str, int] | None = None  # where the current world's store listens
        self._init_members()
        self._built: list[str] = []
        # Ranks an operation is using; see _hold. "*" marks a whole-pool operation.
        self._busy: set[int | str] = set()
        self._idle = threading.Condition()
        try:
            with self._timed("start"):
                self._connect(devices)
                self._place(self._acquire(devices))
            with self._timed(f"world {devices}"):
                self._form_world()
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_cluster(cls, cluster: ClusterConfig, devices: int | None = None) -> DevicePool:
        """The pool a config's ``cluster`` section asks for (``devices`` overrides its slot count)."""
        return cls(
            cluster.devices if devices is None else devices,
            scheduler_address=cluster.scheduler_address,
            backend=cluster.backend,
            tls=TlsFiles.of(cluster),
        )

    # ----------------------------------------------------------------- public

    @property
    def built_layouts(self) -> tuple[str, ...]:
        """Keys of the layouts whose groups exist in the current world."""
        return tuple(self._built)

    def info(self) -> list[dict[str, Any]]:
        """Each actor's ``info()``, in rank order."""
        with self._hold():
            return self._gather("info", [self._call(r, "info") for r in range(self.size)], None)

    def build_groups(self, layout: Layout) -> None:
        """Create ``layout``'s process groups on every device (collective, issued concurrently)."""
        error = layout.devices_error(self.size)
        if error is not None:
            raise ValueError(f"layout {layout.key}: {error}")
        if layout.key in self._built:
            return
        with self._hold(), self._timed(f"build_groups {layout.key}"):
            calls = [self._call(r, "build_groups", layout) for r in range(self.size)]
            self._gather(f"build_groups({layout.key})", calls, self.collective_timeout_s)
        self._built.append(layout.key)

    def run(
        self,
        layout: Layout,
        fn: Callable[..., Any],
        /,
        per_rank_args: Sequence[tuple[Any, ...]] | None = None,
        **common_kwargs: Any,
    ) -> list[Any]:
        """``fn(ctx, *per_rank_args[i], **common_kwargs)`` on ``layout.devices[i]``; results in that order.

        ``layout`` and ``fn`` are positional-only, so ``fn`` may take keywords of those names.
        """
        error = layout.devices_error(self.size)
        if error is not None:
            raise ValueError(f"layout {layout.key}: {error}")
        return self.run_on(layout.devices, fn, per_rank_args, **common_kwargs)

    def run_all(
        self,
        fn: Callable[..., Any],
        /,
        per_rank_args: Sequence[tuple[Any, ...]] | None = None,
        **common_kwargs: Any,
    ) -> list[Any]:
        """``fn`` on every device, results in rank order."""
        return self.run_on(range(self.size), fn, per_rank_args, **common_kwargs)

    def run_on(
        self,
        ranks: Sequence[int],
        fn: Callable[..., Any],
        /,
        per_rank_args: Sequence[tuple[Any, ...]] | None = None,
        **common_kwargs: Any,
    ) -> list[Any]:
        """``fn`` on the given world ranks concurrently; results in the order of ``ranks``."""
        ranks = list(ranks)
        if per_rank_args is not None and len(per_rank_args) != len(ranks):
            raise ValueError(f"per_rank_args has {len(per_rank_args)} entries for {len(ranks)} devices")
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise ValueError(f"rank {bad[0]} is outside the pool; valid ranks are 0..{self.size - 1}")
        with self._hold(ranks):
            calls = [
                self._call(r, "run", fn, *(per_rank_args[i] if per_rank_args else ()), **common_kwargs)
                for i, r in enumerate(ranks)
            ]
            return self._gather(f"run({getattr(fn, '__qualname__', fn)})", calls, None)

    def resize(self, devices: int) -> None:
        """Grow or shrink to ``devices`` and rebuild the world (same size: just rebuild it). Workers
        ``prepare`` started join (resize waits for them); those not needed leave the world and are
        retired by ``retire_left`` (or when the pool closes)."""
        if devices < 1:
            raise ValueError(f"devices={devices}; a pool needs at least 1 device")
        old = self.size
        with self._hold(), self._timed(f"rebuild {old}->{devices}"):
            cold = self._adopt_prepared()
            self._prune_lost()
            self._leave_all()
            self._built.clear()
            if devices < self.size:
                self._let_go(self._workers[devices:])  # they retire after the switch: retire_left
            if devices > self.size:
                self.retire_left()
                fresh = self._acquire(devices)
                self._place(fresh)
                cold += fresh
            self._cold = tuple(r for r, a in enumerate(self._workers) if a in cold)
            self._form_world()
        logger.info("device pool resized %d -> %d", old, devices)

    def close(self) -> None:
        """Actors leave the world; the client closes; a cluster this pool started shuts down."""
        with self._hold():
            self._close()

    def _close(self) -> None:
        self._adopt_prepared(stop=True)  # a grow that never came: its workers go with the others
        if self._actors:
            try:
                self._leave_all()
            except DevicePoolError as exc:  # closing anyway; report and go on
                logger.warning("device pool close: %s", exc.args[0].splitlines()[0])
        self._actors.clear()
        self._futures.clear()
        self._workers.clear()
        self._built.clear()
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ world

    def _form_world(self) -> None:
        """All actors join a fresh world: rank 0's own address is the master, on a port it holds open."""
        n = self.size
        if self.backend is None:
            self.backend = self._resolve_backend()
        host = get_address_host(self._workers[0])
        port = self._gather("open_rendezvous", [self._call(0, "open_rendezvous")], self.join_timeout_s)[0]
        ranks_on_host = local_ranks(self._workers)
        opts = {"timeout_s": self.collective_timeout_s, "torch_threads": self.torch_threads}
        calls = [
            self._call(r, "join", r, n, host, port, self.backend, local_rank=ranks_on_host[r], **opts)
            for r in range(n)
        ]
        self._gather("join", calls, self.join_timeout_s)
        self.rendezvous = (host, port)
        logger.info("device pool: world of %d formed (%s, master %s:%d)", n, self.backend, host, port)

    def _resolve_backend(self) -> str:
        if self.requested_backend != "auto":
            return self.requested_backend
        probes = self._gather("probe", [self._call(r, "probe") for r in range(self.size)], None)
        return "nccl" if all(p["cuda_devices"] > 0 for p in probes) else "gloo"

    def _leave_all(self) -> None:
        calls = [self._call(r, "leave") for r in range(self.size)]
        self._gather("leave", calls, self.join_timeout_s)

    # ---------------------------------------------------------------- helpers

    def _call(self, rank: int, method: str, /, *args: Any, **kwargs: Any) -> tuple[int, Any]:
        a = self._workers[rank]
        return rank, issue(lambda: self._cluster_().call_actor(a, self._actors[a], method, *args, **kwargs))

    def _gather(self, call: str, calls: list[tuple[int, Any]], timeout_s: float | None) -> list[Any]:
        return gather(
            call, calls, self._workers, timeout_s=timeout_s, grace_s=self.failure_grace_s, lost=self._lost
        )

    def _lost(self, ranks: Sequence[int], settle_s: float) -> dict[int, str]:
        return self._book.lost(self._cluster_(), self._workers, ranks, settle_s)

    @contextmanager
    def _hold(self, ranks: Sequence[int] | None = None) -> Iterator[None]:
        """Hold ``ranks`` (None: the whole pool) for one operation, waiting for operations using them.

        Each actor runs its calls one at a time in arrival order, and calls issued
        from different driver threads may arrive in different orders on different
        actors; two collective operations sharing devices could then deadlock.
        Operations on disjoint devices (disaggregated model-stages) still overlap.
        """
        want: set[int | str] = {"*"} if ranks is None else set(ranks)

        def free() -> bool:
            return not self._busy or ("*" not in want and "*" not in self._busy and not want & self._busy)

        with self._idle:
            self._idle.wait_for(free)
            self._busy |= want
        try:
            yield
        finally:
            with self._idle:
                self._busy -= want
                self._idle.notify_all()

    @contextmanager
    def _timed(self, event: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.timings.append((event, seconds))
        logger.info("device pool: %s took %.3fs", event, seconds)
