"""``nereus run`` killed with SIGKILL leaves no process behind: its temporary Prefect
server, Dask workers and watchdog all end within seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.support.processes import running, wait_for

ROOT = Path(__file__).resolve().parents[3]


def _session(sid: int) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                out.append(proc)
        except (ProcessLookupError, PermissionError):
            pass
    return out


def _names(procs: list[psutil.Process]) -> list[str]:
    names = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            names.append(" ".join(proc.cmdline())[:120])
    return names


def test_a_killed_driver_leaves_no_process(tmp_path: Path) -> None:
    """``nereus run`` in a session of its own, SIGKILL of the driver only: its temporary Prefect
    server, its Dask workers and its watchdog end within seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "NEREUS_"))}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli.main",
            "run",
            str(ROOT / "examples" / "tiny_ppo.yaml"),
            "--steps",
            "50",
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    watched: list[psutil.Process] = []
    try:

        def server_and_workers_up() -> bool:
            assert driver.poll() is None, "the run ended before it could be killed"
            kids = psutil.Process(driver.pid).children(recursive=True)
            lines = _names(kids)
            watched[:] = kids
            return (
                any("uvicorn" in line for line in lines)
                and sum("spawn" in line or "forkserver" in line for line in lines) >= 1
            )

        wait_for("the temporary server and the workers", server_and_workers_up, limit=300, every=1)
        time.sleep(3)
        watched[:] = psutil.Process(driver.pid).children(recursive=True)
        names = _names(watched)
        assert any("flows.cli.watchdog" in line for line in names), names
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        started = time.monotonic()

        def all_gone() -> bool:
            return not [p for p in watched if running(p)] and not _session(driver.pid)

        seconds = wait_for("every process of the run to end", all_gone, limit=30, every=0.5)
        gone = time.monotonic() - started
        print(f"\n{len(watched)} processes of the killed driver all ended {gone:.1f} s after SIGKILL")
        assert seconds < 30
    finally:
        for proc in [*_session(driver.pid), *watched]:
            with contextlib.suppress(psutil.Error):
                proc.kill()
