"""Tests of tasks/runtime/device_pool.py and tasks/runtime/cluster.py: real Dask workers forming a real
gloo world."""

from __future__ import annotations

import ipaddress
import logging
import logging.handlers
import os
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cloudpickle
import dask
import psutil
import pytest
import torch
import torch.distributed as dist
from distributed import LocalCluster
from distributed.security import Security

from nereus_core import faults
from nereus_core.config import ConfigError, parse_config
from nereus_core.engine.device import DeviceContext
from nereus_core.layout import Layout
from tasks.runtime.cluster import ClusterError, DaskCluster, TlsFiles
from tasks.runtime.device_pool import DevicePool, DevicePoolError, DeviceRunError
from tasks.runtime.pool_workers import wait_until
from tests.support.pool_checks import tp_sum, warm_note, world_sum

# The per-rank helpers below travel to the workers by value: the workers need
# not be able to import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------- per-rank helpers


def value_sum(ctx: DeviceContext, value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t)
    return t.item()


def echo(ctx: DeviceContext, a: Any, *, b: Any = None) -> tuple[int, Any, Any]:
    return ctx.rank, a, b


def fail_on_odd(ctx: DeviceContext, word: str) -> int:
    if ctx.rank % 2:
        raise ValueError(f"{word} on rank {ctx.rank}")
    return ctx.rank


def armed_here(ctx: DeviceContext) -> tuple[str, ...]:
    return faults.armed_points()


def _listeners(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket owned by ``pids``."""
    out = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                out.append((pid, conn.laddr.ip, conn.laddr.port))
    return out


def _exposed(listeners: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    """The listeners another machine could reach: any address but loopback (:: and 0.0.0.0 included)."""
    return [item for item in listeners if not ipaddress.ip_address(item[1].split("%")[0]).is_loopback]


# ------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def pool2() -> Iterator[DevicePool]:
    with DevicePool(2) as pool:
        yield pool


def test_world_forms_and_all_reduces(pool2: DevicePool) -> None:
    assert pool2.size == 2 and pool2.backend == "gloo"
    assert pool2.run_all(world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]
    infos = pool2.info()
    assert [i["rank"] for i in infos] == [0, 1]
    assert [i["worker"] for i in infos] == list(pool2.workers)
    assert len({i["pid"] for i in infos}) == 2
    events = [e for e, _ in pool2.timings]
    assert events[:2] == ["start", "world 2"]


def test_run_passes_per_rank_and_common_args(pool2: DevicePool) -> None:
    layout = Layout(tp=2, devices=(1, 0))
    out = pool2.run(layout, echo, [("x",), ("y",)], b=7)
    assert out == [(1, "x", 7), (0, "y", 7)]
    with pytest.raises(ValueError, match="per_rank_args has 1 entries for 2 devices"):
        pool2.run(layout, echo, [("x",)])
    with pytest.raises(ValueError, match=r"exceeds cluster\.devices=2"):
        pool2.run(Layout.contiguous(tp=4), echo)


def test_build_groups_and_tp_all_reduce(pool2: DevicePool) -> None:
    layout = Layout.contiguous(tp=2)
    pool2.build_groups(layout)
    assert layout.key in pool2.built_layouts
    assert pool2.run(layout, tp_sum, layout=layout) == [((0, 1), 1.0), ((0, 1), 1.0)]
    assert any(e == f"build_groups {layout.key}" for e, _ in pool2.timings)


def test_failing_fn_raises_with_remote_traceback(pool2: DevicePool) -> None:
    with pytest.raises(DeviceRunError) as info:
        pool2.run_all(fail_on_odd, word="kaboom")
    text = str(info.value)
    assert "failed on rank(s) [1]" in text
    assert "ValueError: kaboom on rank 1" in text
    assert "fail_on_odd" in text and "Traceback" in text
    assert info.value.failures[0].exc_type == "ValueError"
    # A failure outside a collective leaves the world usable.
    assert pool2.run_all(world_sum)[0] == (0, 2, 3.0)


def test_concurrent_callers_do_not_interleave_collectives(pool2: DevicePool) -> None:
    # Two driver threads (e.g. two Prefect tasks) issuing collectives on the same devices: without
    # the pool's per-device hold, rank 0 can pair one thread's all-reduce with the other's on rank 1.
    with ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(lambda v: [pool2.run_all(value_sum, value=v) for _ in range(10)], [1.0, 10.0]))
    assert outs == [[[2.0, 2.0]] * 10, [[20.0, 20.0]] * 10]


def test_no_listener_of_a_local_pool_is_reachable_from_another_machine(pool2: DevicePool) -> None:
    me = psutil.Process()
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}  # driver, nannies, workers
    listeners = _listeners(pids)
    assert _exposed(listeners) == [], "a local pool listens beyond loopback"
    # The world's rendezvous store is among them, served by rank 0's worker on loopback.
    host, port = pool2.rendezvous or ("", 0)
    rank0 = pool2.info()[0]["pid"]
    assert (rank0, "127.0.0.1", port) in listeners and host == "127.0.0.1"


def test_exposed_listeners_are_caught() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))  # every interface, as torch's store binds by default
        sock.listen(1)
        port = sock.getsockname()[1]
        found = _exposed(_listeners({psutil.Process().pid}))
    assert ("0.0.0.0", port) in [(address, p) for _, address, p in found]


def test_workers_arm_the_fault_points_armed_in_the_driver() -> None:
    faults.arm(["fail-snapshot-write"])
    try:
        with DevicePool(1) as pool:
            assert pool.run_all(armed_here) == [("fail-snapshot-write",)]
    finally:
        faults.arm(())
    assert faults.armed_points() == ()


def test_external_scheduler_uses_its_workers() -> None:
    with DaskCluster(3) as c:
        with DevicePool(2, scheduler_address=c.address) as pool:
            assert pool.run_all(world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]
            pool.resize(3)
            assert pool.run_all(world_sum)[0] == (0, 3, 6.0)
        with pytest.raises(DevicePoolError, match=r"has 3 workers .* need 4 devices"):
            DevicePool(4, scheduler_address=c.address, worker_timeout_s=0.5)
        assert len(c.worker_names()) == 3  # the pool did not stop workers it does not own


def test_the_workers_read_as_present_while_the_client_refreshes_its_cached_identity() -> None:
    """Dask's client refreshes its cached scheduler identity in the background with no workers in
    it; a check for lost workers that read that cache would call every worker lost."""
    with dask.config.set({"distributed.client.scheduler-info-interval": "5ms"}), DaskCluster(2) as c:
        seen = set()
        for _ in range(200):
            seen.add(len(c.worker_names()))
            time.sleep(0.002)
        assert seen == {2}
        assert len(c.nannies()) == 2


def test_a_scheduler_s_other_workers_are_reported_and_a_prepared_grow_is_ready_once_warm() -> None:
    """The job grows onto workers a scheduler reports once they are warm, not before."""
    with DaskCluster(3) as c, DevicePool(2, scheduler_address=c.address) as pool:
        assert pool.ready_devices == 2 and pool.reported_devices() == 3
        pool.prepare(3, warm=warm_note)
        assert wait_until(lambda: pool.ready_devices == 3, 120.0)
        pool.resize(3)
        assert pool.run_all(world_sum)[0] == (0, 3, 6.0) and pool.cold_ranks == ()
        assert pool.ready_devices == 3 and pool.reported_devices() == 3


def test_tls_scheduler_is_reached_with_the_configured_files(tmp_path: Any) -> None:
    made = Security.temporary()  # one CA-signed certificate and key, as PEM text
    paths = {}
    for name, pem in (("ca", made.tls_ca_file), ("cert", made.tls_client_cert), ("key", made.tls_client_key)):
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_text(pem)
    files = TlsFiles(str(paths["ca"]), str(paths["cert"]), str(paths["key"]))
    with LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        host="127.0.0.1",
        protocol="tls://",
        security=made,
        dashboard_address=None,
        silence_logs=logging.ERROR,
    ) as c:
        assert c.scheduler_address.startswith("tls://")
        tls = {"tls_ca_file": files.ca_file, "tls_cert_file": files.cert_file, "tls_key_file": files.key_file}
        cfg = parse_config({"cluster": {"scheduler_address": c.scheduler_address, **tls}})
        with DevicePool.for_cluster(cfg.cluster, devices=1) as pool:
            assert pool.tls == files
            assert pool.run_all(world_sum) == [(0, 1, 1.0)]
    missing = TlsFiles(str(tmp_path / "nope.pem"), files.cert_file, files.key_file)
    with pytest.raises(ClusterError, match=r"^cluster\.tls_ca_file: .*nope\.pem is not a readable file"):
        missing.security()


def test_tls_files_come_from_the_cluster_config() -> None:
    tls = {"tls_ca_file": "ca.pem", "tls_cert_file": "c.pem", "tls_key_file": "k.pem"}
    cfg = parse_config({"cluster": {"scheduler_address": "tls://10.0.0.1:8786", **tls}})
    assert TlsFiles.of(cfg.cluster) == TlsFiles("ca.pem", "c.pem", "k.pem")
    assert TlsFiles.of(parse_config({}).cluster) is None
    with pytest.raises(ConfigError, match=r"tls_ca_file is set but .* is not tls://"):
        parse_config({"cluster": {"scheduler_address": "tcp://10.0.0.1:8786", **tls}})
    with pytest.raises(ConfigError, match=r"is tls:// but cluster\.tls_key_file is not set"):
        parse_config(
            {
                "cluster": {
                    "scheduler_address": "tls://10.0.0.1:8786",
                    "tls_ca_file": "a",
                    "tls_cert_file": "b",
                }
            }
        )


def test_plain_tcp_to_another_host_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tasks.runtime.cluster")
    with pytest.raises(ClusterError, match=r"cannot reach the Dask scheduler at tcp://192\.0\.2\.1:8786"):
        DaskCluster(1, "tcp://192.0.2.1:8786", connect_timeout_s=0.5)  # TEST-NET-1: nobody answers
    warned = [r.getMessage() for r in caplog.records if r.name == "tasks.runtime.cluster"]
    assert len(warned) == 1 and "anyone who can reach it can run code on its workers" in warned[0]
    caplog.clear()
    with pytest.raises(ClusterError):
        DaskCluster(1, "tcp://127.0.0.1:9", connect_timeout_s=0.5)
    assert not [r for r in caplog.records if r.name == "tasks.runtime.cluster"]  # loopback: not another host


def test_unknown_scheduler_is_one_clear_error() -> None:
    with pytest.raises(
        DevicePoolError, match=r"cannot reach the Dask scheduler at tcp://127.0.0.1:9 within 1s"
    ):
        DevicePool(2, scheduler_address="tcp://127.0.0.1:9", connect_timeout_s=1)


# ------------------------------------------- Bounded waits, shadowing, lost workers
# These use pool2 and run last in this module: the final one kills one of its workers.


def path_and_storage(ctx: DeviceContext) -> tuple[list[str], str | None]:
    import storage

    return list(sys.path), storage.__file__


def test_a_worker_imports_nereus_from_the_driver_s_installation_not_its_local_directory(
    pool2: DevicePool,
) -> None:
    """A worker's local directory holds Dask's ``storage/`` spill folder and Dask puts it first on the
    import path; the pool takes it off before the actor is placed."""
    import storage

    for path, storage_file in pool2.run_all(path_and_storage):
        assert not [p for p in path if "dask-scratch-space" in p], path
        assert storage_file == storage.__file__


def test_an_argument_the_worker_cannot_unpickle_fails_the_call_at_once(pool2: DevicePool) -> None:
    """Dask's actor proxy waited for ever here; the call now fails with the worker's message."""
    module = types.ModuleType("only_in_the_driver")
    exec("class Thing:\n    pass\n", module.__dict__)
    module.Thing.__module__ = module.__name__
    sys.modules[module.__name__] = module
    try:
        start = time.monotonic()
        with pytest.raises(DeviceRunError, match=r"No module named 'only_in_the_driver'"):
            pool2.run_all(echo, [(module.Thing(),), (module.Thing(),)])
        assert time.monotonic() - start < 20
    finally:
        del sys.modules[module.__name__]
    assert pool2.run_all(world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]  # the actors were never touched


def worker_pid(ctx: DeviceContext) -> int:
    return os.getpid()


def nap_on_rank_1(ctx: DeviceContext) -> int:
    if ctx.rank == 1:
        time.sleep(120)
    return ctx.rank


def test_a_worker_killed_mid_call_is_reported_as_lost_with_its_cause(pool2: DevicePool) -> None:
    """SIGKILL is what the kernel's OOM killer sends; the call fails within seconds, not at the
    end of the sleep, naming the slot, the worker and the cause its nanny logged."""
    (pid,) = pool2.run_on([1], worker_pid)
    worker = pool2.workers[1]
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(DeviceRunError) as info:
        pool2.run_all(nap_on_rank_1)
    assert time.monotonic() - start < 30
    message = str(info.value).splitlines()[0]
    assert f"device slot 1 (worker {worker}) was lost: " in message and "out of memory?" in message
    # The nanny's own line names the signal when it is logged before the 10 s the pool waits for it;
    # on a loaded machine it can come later, and the message then says so instead of guessing.
    named = f"Worker process {pid} was killed by signal 9" in message
    assert named or "its nanny logged no cause" in message, message
    assert [f.rank for f in info.value.failures] == [1]
