"""The device actor: one per Dask worker, the holder of that worker's device slot.

Boundary: the actor owns one ``nereus_core.engine.device.DeviceContext`` and
carries out what the driver asks (join or leave the torch.distributed world,
build a layout's groups, run a core function with the context). It holds no
policy: which function runs where is decided by nereus_core.engine (the device-side code), and
the rendezvous (ranks, master address and port) by ``tasks.runtime.device_pool``. What the
world needs of the process is set here: the variables DeepSpeed reads, the network
interface gloo and NCCL listen on (the one of the worker's own Dask address: loopback
for a local cluster), and the fault points the driver armed (``nereus_core.faults``).

Dask runs the methods of an actor in one dedicated thread on its worker, so the
blocking torch.distributed calls made here never share a thread with another
call on the same device. Failures come back to the driver as ``RankFailure``
(type, message and the remote traceback as text); ``gather`` turns the failures
of one call on several devices into one ``DeviceRunError``.
"""

from __future__ import annotations

import functools
import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, ParamSpec, TypeVar

import torch

from nereus_core import faults
from nereus_core.engine.device import DeviceContext
from nereus_core.layout import Coord, Layout
from tasks.runtime.cluster import get_address_host, get_worker, interface_of

P = ParamSpec("P")
R = TypeVar("R")

BACKENDS = ("gloo", "nccl")


class RankFailure(Exception):
    """An exception raised on one device, shipped to the driver as text.

    The original exception may not unpickle on the driver (or may not pickle at
    all), so the actor sends its type name, message and formatted traceback.
    """

    def __init__(
        self, rank: int | None, worker: str, call: str, exc_type: str, message: str, tb: str
    ) -> None:
        super().__init__(f"{call} failed on rank {rank} ({worker}): {exc_type}: {message}")
        self.rank = rank
        self.worker = worker
        self.call = call
        self.exc_type = exc_type
        self.message = message
        self.traceback_text = tb

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            RankFailure,
            (self.rank, self.worker, self.call, self.exc_type, self.message, self.traceback_text),
        )


class DevicePoolError(RuntimeError):
    """The pool could not be formed or changed (scheduler unreachable, too few workers, timeouts)."""


class DeviceRunError(DevicePoolError):
    """A call failed on one or more devices; carries each rank's remote traceback."""

    def __init__(self, call: str, failures: list[RankFailure], line: str | None = None) -> None:
        ranks = [f.rank for f in failures]
        first = failures[0]
        # A lost or silent worker sent no traceback: its one line is the whole message.
        remote = (
            f"\n--- remote traceback (rank {first.rank}, {first.worker}) ---\n{first.traceback_text}"
            if first.traceback_text
            else ""
        )
        super().__init__(
            line or f"{call} failed on rank(s) {ranks}: {first.exc_type}: {first.message}{remote}"
        )
        self.call = call
        self.failures = failures
        self.line = line

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.failures, self.line))


class DeviceHungError(DeviceRunError):
    """A call's deadline passed with ranks that gave no answer; ``str(err)`` is one line naming them."""


# A call's ranks are polled this often for lost workers while the driver waits on them.
POLL_S = 2.0
# After a call's connection breaks, how long the scheduler gets to notice that its worker is gone.
SETTLE_S = 5.0

# Ranks whose workers are gone, each with one line that says so: ``lost(ranks, settle_s)``.
LostCheck = Callable[[Sequence[int], float], dict[int, str]]


def issue(call: Callable[[], Future[Any]]) -> Future[Any]:
    """Start ``call`` (a call on an actor) without waiting; a failure to start comes back from ``gather``."""
    try:
        return call()
    except Exception as exc:  # e.g. the client is closed
        failed: Future[Any] = Future()
        failed.set_exception(exc)
        return failed


def gather(
    call: str,
    calls: list[tuple[int, Future[Any]]],
    workers: Sequence[str],
    *,
    timeout_s: float | None,
    grace_s: float,
    lost: LostCheck | None = None,
) -> list[Any]:
    """Await every issued ``(rank, future)``, then raise ``DeviceRunError`` if any failed.

    Once one rank has failed, the others get at most ``grace_s`` more: a rank blocked in a
    collective with the failed one would otherwise wait for the whole collective timeout. Without
    a ``timeout_s`` (a stage may run for hours) the wait is still bounded: ``lost`` is asked every
    ``POLL_S`` which ranks' workers are gone (the scheduler drops a worker that stops answering).
    """
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    results: list[Any] = [None] * len(calls)
    failures: dict[int, RankFailure] = {}
    pending = dict(enumerate(calls))

    def fail(i: int, rank: int, failure: RankFailure | tuple[str, str]) -> None:
        if isinstance(failure, tuple):  # (type, message) of a failure with no remote traceback
            failure = RankFailure(rank, workers[rank] if rank < len(workers) else "?", call, *failure, "")
        failures[i] = failure
        pending.pop(i, None)
        nonlocal deadline
        grace = time.monotonic() + grace_s
        deadline = grace if deadline is None else min(deadline, grace)

    polled = start
    while pending:
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        done, _ = wait([f for _, f in pending.values()], timeout=max(0.0, left), return_when=FIRST_COMPLETED)
        raised, broken = _collect(done, pending, results)
        for i, (rank, exc) in raised.items():
            fail(i, rank, exc)
        if broken:
            settle = SETTLE_S if any(_is_broken_link(e) for _, e in broken.values()) else 0.0
            gone = lost([r for r, _ in broken.values()], settle) if lost is not None else {}
            for i, (rank, exc) in broken.items():
                why = gone.get(rank)
                fail(i, rank, ("WorkerLost", why) if why else (type(exc).__qualname__, str(exc) or repr(exc)))
        if pending and lost is not None and time.monotonic() - polled >= POLL_S:
            polled = time.monotonic()
            for rank, why in lost([r for r, _ in pending.values()], 0.0).items():
                for i in [i for i, (r, _) in pending.items() if r == rank]:
                    fail(i, rank, ("WorkerLost", why))
        if pending and deadline is not None and time.monotonic() >= deadline:
            waited = time.monotonic() - start
            for i, (rank, _) in list(pending.items()):
                fail(i, rank, ("TimeoutError", f"no answer after {waited:.0f}s"))
    if failures:
        raise DeviceRunError(call, [failures[i] for i in sorted(failures)])
    return results


def _collect(
    done: set[Future[Any]], pending: dict[int, tuple[int, Future[Any]]], results: list[Any]
) -> tuple[dict[int, tuple[int, RankFailure]], dict[int, tuple[int, Exception]]]:
    """Take the ``done`` calls out of ``pending``, their results into ``results``; returns the calls
    whose rank raised (still pending) and those that never reached the method (a lost worker, a bad
    argument: still pending too), each as call index -> (rank, exception)."""
    raised: dict[int, tuple[int, RankFailure]] = {}
    broken: dict[int, tuple[int, Exception]] = {}
    for i, (rank, future) in list(pending.items()):
        if future not in done:
            continue
        try:
            results[i] = future.result()
            del pending[i]
        except RankFailure as exc:
            raised[i] = (rank, exc)
        except Exception as exc:  # the call never reached the method: a lost worker, a bad argument
            broken[i] = (rank, exc)
    return raised, broken


def _is_broken_link(exc: Exception) -> bool:
    """Whether ``exc`` says the connection to a worker broke (rather than the worker refusing the call):
    directly, or as the text of the scheduler's error when it relayed the call."""
    return isinstance(exc, OSError | TimeoutError) or any(
        word in str(exc) for word in ("CommClosedError", "Stream is closed", "OSError", "Timed out")
    )


def _reported(method: Callable[P, R]) -> Callable[P, R]:
    """Turn any exception of an actor method into a ``RankFailure`` with the remote traceback."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except RankFailure:
            raise
        except Exception as exc:
            actor: DeviceActor = args[0]  # type: ignore[assignment]
            fn = args[1] if method.__name__ == "run" and len(args) > 1 else None
            call = f"run({_qualname(fn)})" if fn is not None else method.__name__
            raise RankFailure(
                actor.rank, actor.worker, call, type(exc).__qualname__, str(exc), traceback.format_exc()
            ) from None

    return wrapper


def _qualname(fn: object) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


class DeviceActor:
    """One device slot: its DeviceContext, driven by the pool through Dask actor calls."""

    def __init__(self, slot_key: str, fault_points: Sequence[str] = ()) -> None:
        self.slot_key = slot_key
        self.worker = get_worker().address
        self._ctx: DeviceContext | None = None
        self._in_world = False
        self._rendezvous: socket.socket | None = None  # rank 0's store socket, until it joins
        faults.arm(fault_points)

    @property
    def rank(self) -> int | None:
        return self._ctx.rank if self._ctx is not None else None

    @_reported
    def probe(self) -> dict[str, Any]:
        """What this worker offers: host, pid, CUDA devices."""
        return {
            "worker": self.worker,
            "host": get_address_host(self.worker),
            "pid": os.getpid(),
            "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        }

    @_reported
    def open_rendezvous(self) -> int:
        """Listen on a free port of this worker's own address for the world's store; returns the port.

        Called on rank 0 before every rank joins: the socket is held until this actor's ``join``
        hands it to the store, so the port cannot be taken in between, and ranks that connect
        early wait in its backlog.
        """
        self._close_rendezvous()
        host = get_address_host(self.worker)
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(address)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self._rendezvous = sock
        return int(sock.getsockname()[1])

    @_reported
    def join(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: str,
        *,
        local_rank: int = 0,
        timeout_s: float = 300.0,
        torch_threads: int | None = 1,
    ) -> dict[str, Any]:
        """Join a fresh world as ``rank``; blocks until every rank has joined. Resident objects, kept
        shards and background writes survive."""
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
        kept = self._ctx  # its resident objects, kept shards and background writes go on in the new world
        # DeepSpeed calls torch.distributed's deprecated names on every step; the warnings drown the logs.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
        if self._in_world:
            self.leave()
        listen_fd = None
        if rank == 0:
            if self._rendezvous is None:
                raise RuntimeError("rank 0 joins on the socket of open_rendezvous; call it first")
            listen_fd, self._rendezvous = self._rendezvous.detach(), None  # the store owns it now
        if backend == "nccl":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        elif torch_threads is not None:
            # One worker stands in for one device; several per host must not oversubscribe the cores.
            torch.set_num_threads(torch_threads)
        self._set_environment(rank, world_size, local_rank, master_addr, master_port)
        ctx = DeviceContext.init_world(
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            timeout_s=timeout_s,
            listen_fd=listen_fd,
        )
        if kept is not None:
            ctx.resident, ctx.retired, ctx.background = kept.resident, kept.retired, kept.background
        self._ctx = ctx
        self._in_world = True
        return self.info()

    @_reported
    def leave(self) -> None:
        """Leave the world (its groups die with it); resident objects stay."""
        if self._ctx is not None and self._in_world:
            self._ctx.destroy_world()
        self._in_world = False

    @_reported
    def build_groups(self, layout: Layout) -> Coord | None:
        """Create ``layout``'s groups (collective: every rank of the world must call it)."""
        view = self._context().build_groups(layout)
        return view.coord if view is not None else None

    @_reported
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(ctx, *args, **kwargs)`` with this device's context and return its result."""
        return fn(self._context(), *args, **kwargs)

    @_reported
    def info(self) -> dict[str, Any]:
        """Rank, world size, pid, worker address, built layouts and resident keys."""
        ctx = self._ctx
        return {
            "rank": self.rank,
            "world_size": ctx.world_size if ctx is not None and self._in_world else None,
            "backend": ctx.backend if ctx is not None else None,
            "pid": os.getpid(),
            "worker": self.worker,
            "in_world": self._in_world,
            "layouts": sorted(ctx.groups) if ctx is not None else [],
            "resident": sorted(ctx.resident) if ctx is not None else [],
        }

    def _set_environment(
        self, rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int
    ) -> None:
        """What DeepSpeed reads when it attaches to the world, and the interface gloo and NCCL bind:
        the one holding this worker's own address (loopback for a local cluster), unless set already."""
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(local_rank),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        interface = interface_of(get_address_host(self.worker))
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)

    def _close_rendezvous(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None

    def _context(self) -> DeviceContext:
        if self._ctx is None or not self._in_world:
            raise RuntimeError(
                f"device actor on {self.worker} is not in a world; the pool must join it first"
            )
        return self._ctx
