"""The Dask cluster: the one module of Nereus that imports Dask.

Boundary: ``DaskCluster`` starts a LocalCluster whose every listener (scheduler,
nannies, workers) is bound to the loopback interface and has no dashboard, or
connects a client to an existing scheduler: over TLS when its address is
``tls://`` (``TlsFiles``), with a warning when a plain ``tcp://`` address points at
another host (anyone who reaches such a scheduler can run code on its workers).
It scales and retires the workers of a cluster it started; what runs on them is
its callers' business (``device_pool`` places device actors, ``sim_tasks`` fans out
simulation runs). The few Dask names those callers need are re-exported here, so
that ``tests/test_layering.py`` can hold Dask to this one file. ``interface_of`` names the
network interface of an address, for the device actors' torch.distributed world.

Three things Dask does not do safely for Nereus are done here. A worker puts its local
directory first on ``sys.path``, and that directory holds a ``storage/`` spill directory that would
shadow Nereus's own ``storage`` package: ``guard_imports`` runs ``worker_imports``'s check on each
worker, which takes it off before anything of Nereus is imported there and checks that each Nereus
package resolves as on the driver. Dask's actor proxy leaves a call pending for ever when it fails
before the method runs (an argument the worker cannot unpickle, a lost worker): ``call_actor``
returns a future that always resolves. And when a worker dies, ``worker_exit`` asks its nanny what
it logged (killed by a signal, over its memory budget).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from pathlib import Path
from types import TracebackType
from typing import Any

import dask
import psutil  # a dependency of distributed
from distributed import Actor, Client, Future, KilledWorker, LocalCluster, get_worker
from distributed.client import FutureCancelledError
from distributed.comm import get_address_host
from distributed.protocol import to_serialize
from distributed.security import Security
from distributed.utils import get_mp_context

from nereus_core.config import ClusterConfig
from tasks.runtime.worker_imports import forkserver_preload, import_guard, nereus_packages

__all__ = [
    "LOOPBACK",
    "Actor",
    "Client",
    "ClusterError",
    "DaskCluster",
    "Future",
    "FutureCancelledError",
    "KilledWorker",
    "TlsFiles",
    "get_address_host",
    "get_worker",
    "interface_of",
    "is_loopback",
    "nereus_packages",
]

logger = logging.getLogger(__name__)


def _serialize_bf16_tensors() -> None:
    """Dask serializes a tensor through numpy, which has no bf16 (``model.dtype: bf16``): such a
    tensor travels as its bytes viewed as int16 and is viewed back on arrival (no copy, bitwise)."""
    import torch
    from distributed.protocol import dask_deserialize, dask_serialize
    from distributed.protocol import torch as dask_torch  # Dask's own tensor serializer, wrapped

    @dask_serialize.register(torch.Tensor)
    def dumps(t: torch.Tensor) -> tuple[dict[str, Any], list[Any]]:
        if t.dtype != torch.bfloat16:
            return dask_torch.serialize_torch_Tensor(t)
        header, frames = dask_torch.serialize_torch_Tensor(t.detach().view(torch.int16))
        return {**header, "nereus-bf16": True}, frames

    @dask_deserialize.register(torch.Tensor)
    def loads(header: dict[str, Any], frames: list[Any]) -> torch.Tensor:
        t = dask_torch.deserialize_torch_Tensor(header, frames)
        return t.view(torch.bfloat16) if header.get("nereus-bf16") else t


_serialize_bf16_tensors()

LOOPBACK = "127.0.0.1"


class ClusterError(RuntimeError):
    """The cluster could not be started or reached; ``str(err)`` is one line naming the fix."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a ``tls://`` scheduler: the CA that signed the cluster's certificates, and
    this client's certificate and key."""

    ca_file: str
    cert_file: str
    key_file: str

    @classmethod
    def of(cls, cluster: ClusterConfig) -> TlsFiles | None:
        """The files of ``cluster`` (config validation makes them all-or-nothing), None without TLS."""
        if cluster.tls_ca_file is None or cluster.tls_cert_file is None or cluster.tls_key_file is None:
            return None
        return cls(cluster.tls_ca_file, cluster.tls_cert_file, cluster.tls_key_file)

    def security(self) -> Security:
        """Dask's client-side TLS settings; a file that cannot be read is one ``ClusterError`` line."""
        for field, path in (
            ("tls_ca_file", self.ca_file),
            ("tls_cert_file", self.cert_file),
            ("tls_key_file", self.key_file),
        ):
            if not Path(path).is_file():
                raise ClusterError(
                    f"cluster.{field}: {path} is not a readable file; give the PEM file's path"
                )
        return Security(
            require_encryption=True,
            tls_ca_file=self.ca_file,
            tls_client_cert=self.cert_file,
            tls_client_key=self.key_file,
        )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_of(host: str) -> str | None:
    """Name of this machine's network interface that holds ``host``'s address (``lo`` for 127.0.0.1);
    None when none does. gloo and NCCL listen on it, instead of the one the hostname resolves to."""
    try:
        address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for item in addresses:
            if item.family in (socket.AF_INET, socket.AF_INET6) and item.address.split("%")[0] == address:
                return name
    return None


def _warn_if_plain(address: str) -> None:
    host = get_address_host(address)
    if not address.startswith("tls://") and not is_loopback(host):
        logger.warning(
            "Dask scheduler %s is reached without TLS: anyone who can reach it can run code on its "
            "workers; use a tls:// address with cluster.tls_ca_file, tls_cert_file and tls_key_file, "
            "or keep the scheduler on a network only you can reach",
            address,
        )


class DaskCluster:
    """A client of ``scheduler_address``, or of a LocalCluster of ``workers`` processes on loopback."""

    def __init__(
        self,
        workers: int,
        scheduler_address: str | None = None,
        *,
        tls: TlsFiles | None = None,
        connect_timeout_s: float = 30.0,
        allowed_failures: int | None = None,
        memory_limit: int | None = None,
    ) -> None:
        """For a LocalCluster it starts: ``allowed_failures``, the worker deaths a task survives before
        ``KilledWorker`` (Dask's default: 3); ``memory_limit``, each worker's bytes (None: no limit)."""
        self.scheduler_address = scheduler_address
        self._local: LocalCluster | None = None
        if scheduler_address is None:
            self._local = _local_cluster(workers, allowed_failures, memory_limit)
            self.client = Client(self._local, set_as_default=False)
            return
        _warn_if_plain(scheduler_address)
        security = tls.security() if tls is not None else None
        try:
            self.client = Client(
                scheduler_address, timeout=connect_timeout_s, security=security, set_as_default=False
            )
        except (OSError, TimeoutError) as exc:
            raise ClusterError(
                f"cannot reach the Dask scheduler at {scheduler_address} within {connect_timeout_s:g}s "
                f"({type(exc).__name__}); check the address or start the scheduler"
            ) from None

    @property
    def address(self) -> str:
        """The scheduler's address, as the client reached it."""
        return str(self.client.scheduler.address)

    @property
    def owns_workers(self) -> bool:
        """Whether the workers are this object's to start and stop (a LocalCluster it started)."""
        return self._local is not None

    def worker_names(self) -> dict[str, Any]:
        """Name of every worker the scheduler knows, by address."""
        return {a: w.get("name") for a, w in self._workers_known().items()}

    def worker_health(self) -> dict[str, tuple[int | None, float | None]]:
        """By address: each worker's resident bytes as its last heartbeat reported them and the seconds
        since that heartbeat (None: not reported). A worker's event loop beats while its actor thread
        is busy or blocked in a collective; a stopped or frozen process does not."""
        now = time.time()  # the scheduler stamps last_seen with its own clock (the same host's, or NTP's)
        out: dict[str, tuple[int | None, float | None]] = {}
        for address, w in self._workers_known().items():
            rss = (w.get("metrics") or {}).get("memory")
            seen = w.get("last_seen")
            age = max(0.0, now - float(seen)) if seen is not None else None
            out[address] = (int(rss) if rss is not None else None, age)
        return out

    def nannies(self) -> dict[str, str | None]:
        """The nanny of every worker the scheduler knows (None for a worker without one), by address."""
        return {a: w.get("nanny") for a, w in self._workers_known().items()}

    def _workers_known(self) -> dict[str, dict[str, Any]]:
        """Every worker the scheduler knows, asked afresh. Not ``Client.scheduler_info()``: it returns
        the client's cached identity, which the client's own periodic refresh may overwrite at any
        moment with one that lists no workers at all (it asks for none), so every worker would read
        as lost. ``OSError``/``TimeoutError`` when the scheduler does not answer."""
        identity = self.client.sync(self.client.scheduler.identity, n_workers=-1)
        return dict(identity["workers"])

    def guard_imports(self, addresses: list[str], timeout_s: float) -> dict[str, int]:
        """Take each worker's local directory off its import path, check that Nereus's packages resolve
        there as on the driver, and return each worker's pid; ``ClusterError`` with one line if not."""
        driver = nereus_packages()
        try:
            answers = self.client.run(
                import_guard(),
                driver,
                socket.gethostname(),
                workers=addresses,
                on_error="return",
                callback_timeout=timeout_s,
            )
        except (TimeoutError, OSError) as exc:
            raise ClusterError(
                f"workers {addresses} did not answer within {timeout_s:g}s ({type(exc).__name__}); "
                "check that they are running and reachable"
            ) from None
        pids: dict[str, int] = {}
        for address in addresses:
            answer = answers.get(address)
            if not isinstance(answer, dict):
                raise ClusterError(f"worker {address} could not check its imports: {answer!r}")
            if answer["problem"] is not None:
                name, found = answer["problem"]
                raise ClusterError(
                    f"worker {address}: Nereus's package '{name}' resolves to {found} there, not to "
                    f"{driver[name]} as on the driver; start the worker in the environment where "
                    f"Nereus is installed, from a directory without a '{name}' folder"
                )
            pids[address] = int(answer["pid"])
        return pids

    def call_actor(
        self, address: str, key: str, method: str, /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        """``method(*args, **kwargs)`` on the actor ``key`` that ``address`` holds, without waiting.

        Dask's own actor proxy leaves its future pending for ever when a call fails before the
        method runs (an argument the worker cannot unpickle, a lost worker); this future always
        resolves: with the result, the method's exception, or the one that stopped the call."""
        client = self.client
        msg = {
            "function": method,
            "actor": key,
            "args": [to_serialize(a) for a in args],
            "kwargs": {k: to_serialize(v) for k, v in kwargs.items()},
        }

        async def execute() -> Any:
            if client.direct_to_workers:
                response = await client.rpc(address).actor_execute(**msg)
            else:
                response = await client.scheduler.proxy(worker=address, msg={"op": "actor_execute", **msg})
            if response["status"] == "OK":
                return response["result"]
            raise response["exception"]

        return asyncio.run_coroutine_threadsafe(execute(), client.loop.asyncio_loop)

    def worker_exit(self, nanny: str | None, pid: int | None, wait_s: float = 10.0) -> str | None:
        """What the nanny of a lost worker logged about its process ``pid`` (killed by a signal, over its
        memory budget), or None when it logged nothing or cannot be asked within ``wait_s``."""
        if nanny is None or pid is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            logs = [line for lines in self._nanny_logs(nanny) for _, line in lines]  # newest first
            found = [
                str(x).split(" - ")[-1].strip() for x in logs if f"process {pid} " in x or f"(pid={pid})" in x
            ]
            if found:  # the nanny's memory line comes before its "killed by signal 15" one
                return next((line for line in found if "memory budget" in line), found[0])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.5)

    def _nanny_logs(self, nanny: str) -> list[list[tuple[str, str]]]:
        """The nanny's recent log lines: asked directly, or through the worker it restarted in the lost
        one's place when the driver cannot reach it (the scheduler relays calls to workers only)."""
        client = self.client

        async def direct() -> list[tuple[str, str]]:
            return await client.rpc(nanny).get_logs(n=500)

        try:
            return [client.sync(direct, callback_timeout=2.0)]
        except (OSError, TimeoutError):
            pass
        successors = [a for a, n in self.nannies().items() if n == nanny]
        if not successors:
            return []
        try:
            return list(client.get_worker_logs(n=500, workers=successors[:1], nanny=True).values())
        except (OSError, TimeoutError, KeyError):
            return []

    def scale(self, workers: int) -> None:
        """Ask a LocalCluster this object started for ``workers`` workers; a no-op on a remote scheduler."""
        if self._local is not None:
            self._local.scale(workers)

    def retire(self, names: list[Any]) -> None:
        """Stop the workers of a LocalCluster named ``names`` (the others keep their processes)."""
        if self._local is None:
            return
        for name in names:
            self._local.worker_spec.pop(name, None)
        self._local.scale(len(self._local.worker_spec))

    def close(self) -> None:
        """Close the client; a LocalCluster this object started shuts down with its workers."""
        self.client.close()
        if self._local is not None:
            self._local.close()
            self._local = None

    def __enter__(self) -> DaskCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# Before a worker process starts (glibc reads it once): tensors under 32 MiB (glibc's largest
# threshold) come from the heap, whose freed memory the next shard reuses, instead of fresh mmaps
# that every new shard pays page faults for (fresh memory here: 2.9 GB/s, warm 18 GB/s). With it,
# live reshards of a 70M-parameter model 1.8-2.8x faster (benchmarks/bench_reshard.py --compare-env).
WORKER_PRE_SPAWN_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)}


def worker_processes() -> BaseContext:
    """How local worker processes start: forked from one server per driver that imported what they
    need (``forkserver_preload``) in ``WORKER_PRE_SPAWN_ENV``, whoever starts it first (a pool, a
    test's world); NEREUS_WORKER_START=spawn: each from scratch, in the driver's environment then."""
    method = os.environ.get("NEREUS_WORKER_START", "forkserver")
    dask.config.set({"distributed.worker.multiprocessing-method": method})
    ctx = get_mp_context()
    if method == "forkserver":  # both take effect only before the server starts
        os.environ.update(WORKER_PRE_SPAWN_ENV)
        ctx.set_forkserver_preload(forkserver_preload())
    return ctx


def _local_cluster(
    workers: int, allowed_failures: int | None = None, memory_limit: int | None = None
) -> LocalCluster:
    """Single-threaded worker processes; every listener on loopback, no dashboards; each worker's
    nanny kills it past 95 % of ``memory_limit`` (None: no limit), and it logs why."""
    spawn_env = dask.config.get("distributed.nanny.pre-spawn-environ", {})
    dask.config.set({"distributed.nanny.pre-spawn-environ": {**spawn_env, **WORKER_PRE_SPAWN_ENV}})
    # A device worker's memory is its actor's, not Dask data: spilling has nothing to spill and a
    # paused worker would only stall the job, so the nanny's kill at the limit is the one action.
    dask.config.set({f"distributed.worker.memory.{k}": False for k in ("target", "spill", "pause")})
    worker_processes()
    return LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        host=LOOPBACK,
        protocol="tcp://",
        dashboard_address=None,
        worker_dashboard_address=None,
        # The scheduler's HTTP server starts even without a dashboard, on 8787 by default.
        scheduler_kwargs={
            "dashboard": False,
            "dashboard_address": f"{LOOPBACK}:0",
            "allowed_failures": allowed_failures,
        },
        memory_limit=memory_limit or 0,
        silence_logs=logging.ERROR,
    )
