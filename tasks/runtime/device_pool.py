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
futures always resolve; while the driver waits on a call, the ranks' workers are polled,
so that a lost one fails the call with its cause (``tasks.runtime.pool_workers``); and every call
has a deadline (``call_deadline_s``: a floor plus seconds per token of its work), past which the
ranks that gave no answer are named in one line (``DeviceHungError``) and left out of the pool's
closing (a LocalCluster's are killed) so that the job fails instead of waiting for ever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from nereus_core.config import ClusterConfig
from nereus_core.layout import Layout
from tasks.runtime.call_work import call_label, call_tokens
from tasks.runtime.cluster import TlsFiles, get_address_host
from tasks.runtime.device_actor import (
    POLL_S,
    DeviceHungError,
    DevicePoolError,
    DeviceRunError,
    RankFailure,
    gather,
    issue,
)
from tasks.runtime.pool_members import PoolMembers, worker_memory_limit
from tasks.runtime.pool_workers import by_rank, kill_children, local_ranks

__all__ = ["DeviceHungError", "DevicePool", "DevicePoolError", "DeviceRunError", "RankFailure"]

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
        self._init_members()
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

    # ---------------------------------------------------------------- helpers

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
