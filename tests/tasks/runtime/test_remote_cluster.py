"""Several machines, on loopback: ``dask scheduler`` and ``dask worker`` started as the README says.

The worker runs with Dask's default options, so its local directory holds the ``storage/`` spill
folder that Dask puts first on its import path (it shadowed Nereus's ``storage`` and the
driver waited for ever). Both run in a working directory that holds a ``storage/`` folder too. A
PPO job then runs through them with a checkpoint and a durable switch (a device change), and a
worker whose ``storage`` really resolves to a folder is refused in one line naming it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pyarrow.parquet as pq
import pytest
from distributed import Client

from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from storage.run_dir import RunDir
from tasks.runtime.device_pool import DevicePool, DevicePoolError
from tests.support.job_configs import SMALL_MODEL

# The helpers below travel to the workers by value: the workers cannot import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("prefect_server")]

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[3]

# A small model at two slots, a checkpoint every step, and the pool shrinking to one slot
# before step 2: a forced durable switch through the checkpoint of step 1.
CONFIG = {
    "name": "remote-test",
    "cluster": {"devices": 2, "memory_per_device": "64MiB"},
    "model": dict(SMALL_MODEL),
    "job": {
        "steps": 3,
        "batch_size": 8,
        "prompt_len": 4,
        "response_len": 4,
        "snapshot_every": 1,
        "scenario": [{"step": 2, "devices": 1}],
    },
    "ppo": {"reward_fit_steps": 2, "reward_fit_batch": 8, "ppo_epochs": 1, "mini_batches": 1},
    "plan": {
        "actor/generate": {"dp": 2, "devices": [0, 1]},
        "actor/train": {"dp": 2, "devices": [0, 1]},
        "critic/train": {"dp": 2, "devices": [0, 1]},
        "critic/infer": {"dp": 2, "devices": [0, 1]},
        "reference/infer": {"devices": [1]},
        "reward/infer": {"devices": [0]},
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate each process group (the worker's nanny and its children), then kill what is left."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@contextlib.contextmanager
def _dask(cwd: Path, worker: list[str], nworkers: int) -> Iterator[str]:
    """``dask scheduler`` on loopback and ``worker`` (a command line) pointed at it, run in ``cwd``;
    yields the scheduler's address once ``nworkers`` workers have joined. Every process dies after."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "NEREUS_CACHE_DIR": str(cwd / "cache")}
    log = (cwd / "dask.log").open("w")
    port = address.rsplit(":", 1)[1]
    scheduler = [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", port, "--no-dashboard"]
    procs: list[subprocess.Popen] = []
    try:
        for argv in (scheduler, [*worker, address]):
            procs.append(
                subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=log, start_new_session=True)
            )
            time.sleep(0.5)
        with Client(address, timeout=60) as client:
            client.wait_for_workers(nworkers, timeout=90)
        yield address
    finally:
        _stop(procs)
        log.close()


def where_storage_resolves(dask_worker: Any = None) -> dict[str, Any]:
    """What a fresh worker would import as ``storage``, and whether its local directory spills there."""
    import importlib.util

    spec = importlib.util.find_spec("storage")
    return {
        "origin": spec.origin if spec is not None else None,
        "spill_dir": os.path.isdir(os.path.join(dask_worker.local_directory, "storage")),
        "first_on_path": sys.path[0] == dask_worker.local_directory,
    }


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A working directory that holds a ``storage/`` folder, as a user's might."""
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "__pycache__").mkdir()
    return tmp_path


@pytest.mark.slow  # ~60 s; an external scheduler's workers run in the default suite (test_device_pool.py)
def test_ppo_steps_with_a_checkpoint_and_a_durable_switch_run_on_separate_dask_processes(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = [str(BIN / "dask"), "worker", "--nworkers", "2", "--nthreads", "1"]  # default options
    with _dask(workdir, worker, 2) as address:
        with Client(address, timeout=30) as client:
            before = client.run(where_storage_resolves)
        # Without the pool's guard, these workers import a folder as Nereus's storage package.
        for facts in before.values():
            assert facts["spill_dir"] and facts["first_on_path"] and facts["origin"] is None, facts
        out = workdir / "run"
        data = {**CONFIG, "cluster": {**CONFIG["cluster"], "scheduler_address": address}}
        monkeypatch.setenv("NEREUS_CACHE_DIR", str(workdir / "cache"))
        start = time.monotonic()
        rl_job(config=parse_config(data), out_dir=str(out))
        seconds = time.monotonic() - start
    summary = RunDir(out).read_summary()
    assert summary["status"] == "completed" and summary["steps"] == 3, summary
    assert RunDir(out).checkpoint_steps(), "no checkpoint was written"
    rows = pq.read_table(out / "metrics" / "transitions.parquet").to_pylist()
    committed = [r for r in rows if r["status"] == "committed"]
    assert [r["route"] for r in committed] == ["durable"], rows
    print(f"remote PPO job: 3 steps, 1 durable switch in {seconds:.1f}s")


def test_a_worker_whose_storage_is_a_folder_is_refused_in_one_line(workdir: Path) -> None:
    """``python -m`` puts the working directory first on the path: its ``storage/`` folder wins over
    the installed package, and no guard can take the working directory away; the pool says so."""
    worker = [sys.executable, "-m", "distributed.cli.dask_worker", "--nworkers", "2", "--nthreads", "1"]
    with _dask(workdir, worker, 2) as address:
        start = time.monotonic()
        with pytest.raises(DevicePoolError) as info:
            DevicePool(1, scheduler_address=address, worker_timeout_s=30)
        assert time.monotonic() - start < 30
        sets = ["job.scenario=[]", f"cluster.scheduler_address={address}"]
        cli = subprocess.run(  # the same through ``nereus run``: its last word is one line
            [sys.executable, "-m", "flows.cli.main", "run", str(ROOT / "examples" / "tiny_ppo.yaml")]
            + ["--steps", "1", "--out", str(workdir / "run")]
            + [arg for item in sets for arg in ("--set", item)],
            cwd=ROOT,
            env={**os.environ, "NEREUS_CACHE_DIR": str(workdir / "cache")},
            capture_output=True,
            text=True,
            timeout=120,
        )
    message = str(info.value)
    assert "\n" not in message
    assert "worker tcp://127.0.0.1:" in message
    assert f"Nereus's package 'storage' resolves to the folder {workdir / 'storage'} there" in message
    assert cli.returncode == 1, cli.stderr[-2000:]
    (line,) = [x for x in cli.stderr.splitlines() if x.startswith("nereus: error: ")]
    assert "Nereus's package 'storage' resolves to the folder" in line, line
