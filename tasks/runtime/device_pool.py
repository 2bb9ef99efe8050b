"""The device pool: Dask workers as device slots, joined in one torch.distributed world.

Boundary: the pool owns a ``tasks.runtime.cluster.DaskCluster`` (a LocalCluster on loopback,
or a client of an existing scheduler), places one ``DeviceActor`` on each worker it
uses, arms on it the fault points armed in the driver, and forms the
torch.distributed world over them. It dispatches calls to the actors and
gathers results; it never decides what runs where (``nereus_core.engine``, the device-side code,
passes top-level functions; the pool runs them on a layout's devices).

Membership: the workers in rank order, their actors, a grow prepared in the background
(``prepare``, run by ``tasks.runtime.pool_growth.Growth``; ``ready_devices`` says when it is warm)
and the workers a shrink let go: a shrink forms the smaller world at once and retires the workers
that left only afterwards (``retire_left``), so that the switch's pause holds no worker shutdown.
Nothing here decides when to grow or shrink: the job flow does.

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
futures always resolve; while the driver waits on a call, the ranks' workers are polled,
so that a lost one fails the call with its cause (``tasks.runtime.pool_workers``); and every call
has a deadline (``call_deadline_s``: a floor plus seconds per token of its work), past which the
ranks that gave no answer are named in one line (``DeviceHungError``) and left out of the pool's
closing (a LocalCluster's are killed) so that the job fails instead of waiting for ever.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch

from nereus_core.config import ClusterConfig
from nereus_core.layout import Layout
from tasks.runtime.call_work import call_label, call_tokens
from tasks.runtime.cluster import Client, ClusterError, DaskCluster, Future, TlsFiles, get_address_host
from tasks.runtime.device_actor import (
    POLL_S,
    DeviceHungError,
    DevicePoolError,
    DeviceRunError,
    RankFailure,
    gather,
    issue,
)
from tasks.runtime.pool_growth import Growth, PlacedActor, Warm, free_workers, place_actors
from tasks.runtime.pool_workers import WorkerBook, by_rank, kill_children, local_ranks, wait_until

__all__ = ["DeviceHungError", "DevicePool", "DevicePoolError", "DeviceRunError", "RankFailure"]

logger = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "gloo", "nccl")
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


class DevicePool:
    """``devices`` device actors over Dask workers, joined in one torch.distributed world."""

    def __init__(
        self,
        devices: int,
        scheduler_address: str | None = None,
        backend: str = "auto",
        *,
        connect_timeout_s: float = 30.0,
        worker_timeout_s: float = 120.0,
        join_timeout_s: float = 180.0,
        collective_timeout_s: float = 300.0,
        call_timeout_s: float = 900.0,
        call_timeout_s_per_token: float = 0.01,
        torch_threads: int | None = 1,
        failure_grace_s: float = 30.0,
        tls: TlsFiles | None = None,
        memory_limit: int | None = None,
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
        self.call_timeout_s = call_timeout_s
        self.call_timeout_s_per_token = call_timeout_s_per_token
        self.memory_limit = memory_limit
        self.torch_threads = torch_threads
        self.failure_grace_s = failure_grace_s
        self.timings: list[tuple[str, float]] = []
        self.rendezvous: tuple[str, int] | None = None  # where the current world's store listens
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
        self._built: list[str] = []
        # Ranks an operation is using; see _hold. "*" marks a whole-pool operation.
        self._busy: set[int | str] = set()
        self._idle = threading.Condition()
        self._scope = threading.local()  # this thread's call label and tokens: see scope
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
            connect_timeout_s=cluster.connect_timeout_s,
            call_timeout_s=cluster.call_timeout_s,
            call_timeout_s_per_token=cluster.call_timeout_s_per_token,
            memory_limit=worker_memory_limit(cluster),
        )

    # ----------------------------------------------------------------- public

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

    @property
    def built_layouts(self) -> tuple[str, ...]:
        """Keys of the layouts whose groups exist in the current world."""
        return tuple(self._built)

    def call_deadline_s(self, tokens: int) -> float:
        """Seconds a device call processing ``tokens`` tokens on one device may take before its ranks
        that gave no answer are named as hung (``cluster.call_timeout_s`` and ``_per_token``)."""
        return self.call_timeout_s + self.call_timeout_s_per_token * tokens

    @contextmanager
    def scope(self, label: str, *, tokens: int | None = None) -> Iterator[None]:
        """Device calls this thread makes inside are reported as ``label`` (a model-stage) and, given
        ``tokens`` (per device: prompt plus generated tokens, say), get their deadline from it instead
        of from the token ids they send."""
        outer = getattr(self._scope, "value", None)
        self._scope.value = (label, tokens)
        try:
            yield
        finally:
            self._scope.value = outer

    def note_memory(self, held: Mapping[int, int], predicted: Mapping[int, int] | None = None) -> None:
        """Each rank's model state as the job measured it (and the plan's prediction for it): a worker
        lost later is reported with them."""
        for address, n in by_rank(self._workers, held).items():
            self._book.note(address, held=n)
        for address, n in by_rank(self._workers, predicted or {}).items():
            self._book.note(address, predicted=n)

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
        label, tokens = getattr(self._scope, "value", None) or (call_label(common_kwargs), None)
        if tokens is None:
            tokens = call_tokens(common_kwargs.values()) + max(map(call_tokens, per_rank_args or [()]))
        deadline_s = self.call_deadline_s(tokens)
        own = [
            v
            for k, v in common_kwargs.items()
            if k in ("deadline_s", "timeout_s") and isinstance(v, float | int)
        ]
        deadline_s = max([deadline_s, *(v + self.failure_grace_s for v in own)])  # a call that bounds itself
        what = f"run({getattr(fn, '__qualname__', fn)})" + (f" for {label}" if label else "")
        stuck = [r for r in ranks if self._workers[r] in self._stuck]
        if stuck:  # its actor is still inside the call that hung: this one would queue behind it
            failures = [RankFailure(r, self._workers[r], what, "TimeoutError", "", "") for r in stuck]
            line = f"{what}: device slot(s) {stuck} gave no answer to an earlier call (see above); not called"
            raise DeviceHungError(what, failures, line)
        with self._hold(ranks):
            calls = [
                self._call(r, "run", fn, *(per_rank_args[i] if per_rank_args else ()), **common_kwargs)
                for i, r in enumerate(ranks)
            ]
            return self._gather(what, calls, deadline_s, label)

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
                # A rank that hung or was lost in a call would not answer this either.
                self._leave_all([r for r, a in enumerate(self._workers) if a not in self._stuck | self._gone])
            except DevicePoolError as exc:  # closing anyway; report and go on
                logger.warning("device pool close: %s", exc.args[0].splitlines()[0])
        if self._stuck and self._cluster is not None and self._cluster.owns_workers:
            pids = [p for p in (self._book.pid(a) for a in self._stuck) if p is not None]
            killed = kill_children(pids)  # a stopped one would hold the cluster's shutdown
            logger.warning("device pool close: killed the workers that gave no answer (pids %s)", killed)
        self._stuck.clear()
        self._gone.clear()
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

    def _leave_all(self, ranks: Iterable[int] | None = None) -> None:
        calls = [self._call(r, "leave") for r in (range(self.size) if ranks is None else ranks)]
        self._gather("leave", calls, self.join_timeout_s)

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

    # ---------------------------------------------------------------- helpers

    def _cluster_(self) -> DaskCluster:
        if self._cluster is None:
            raise DevicePoolError("the device pool is closed")
        return self._cluster

    def _client_(self) -> Client:
        return self._cluster_().client

    def _worker_names(self) -> dict[str, Any]:
        return self._cluster_().worker_names()

    def _call(self, rank: int, method: str, /, *args: Any, **kwargs: Any) -> tuple[int, Any]:
        a = self._workers[rank]
        return rank, issue(lambda: self._cluster_().call_actor(a, self._actors[a], method, *args, **kwargs))

    def _gather(
        self, call: str, calls: list[tuple[int, Any]], timeout_s: float | None, label: str = ""
    ) -> list[Any]:
        """Await ``calls``, each bounded by ``timeout_s`` (None: the floor, ``call_timeout_s``)."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        self._book.observe(self._cluster_(), POLL_S)  # memory before the call: a lost worker's last
        try:
            return gather(
                call, calls, self._workers, timeout_s=timeout_s, grace_s=self.failure_grace_s, lost=self._lost
            )
        except DeviceRunError as err:
            silent = [f.rank for f in err.failures if f.exc_type == "TimeoutError" and not f.traceback_text]
            gone = [f.rank for f in err.failures if f.exc_type == "WorkerLost"]
            self._stuck |= {self._workers[r] for r in silent if r is not None and r < self.size}
            self._gone |= {self._workers[r] for r in gone if r is not None and r < self.size}
            if not silent or any(f.traceback_text for f in err.failures):
                raise  # a rank's own error comes first: the others waited on it
            line = self._book.hung(
                self._cluster_(),
                self._workers,
                [r for r in silent if r is not None],
                call=call,
                label=label or "device pool",
                deadline_s=timeout_s,
            )
            raise DeviceHungError(err.call, err.failures, line) from None

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
