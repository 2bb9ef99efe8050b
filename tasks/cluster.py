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
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil  # a dependency of distributed
from distributed import Actor, Client, Future, LocalCluster, get_worker
from distributed.comm import get_address_host
from distributed.security import Security

from nereus_core.config import ClusterConfig

__all__ = [
    "LOOPBACK",
    "Actor",
    "Client",
    "ClusterError",
    "DaskCluster",
    "Future",
    "TlsFiles",
    "get_address_host",
    "get_worker",
    "interface_of",
    "is_loopback",
]

logger = logging.getLogger(__name__)

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
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.scheduler_address = scheduler_address
        self._local: LocalCluster | None = None
        if scheduler_address is None:
            self._local = _local_cluster(workers)
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
        return {a: w.get("name") for a, w in self.client.scheduler_info()["workers"].items()}

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


def _local_cluster(workers: int) -> LocalCluster:
    """Single-threaded worker processes; every listener on loopback, no dashboards, no memory limit."""
    return LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        host=LOOPBACK,
        protocol="tcp://",
        dashboard_address=None,
        worker_dashboard_address=None,
        # The scheduler's HTTP server starts even without a dashboard, on 8787 by default.
        scheduler_kwargs={"dashboard": False, "dashboard_address": f"{LOOPBACK}:0"},
        memory_limit=0,
        silence_logs=logging.ERROR,
    )
