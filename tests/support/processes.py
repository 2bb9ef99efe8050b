"""The processes a test starts in sessions of their own: waiting on what they do, whether one still
runs, and killing one with everything in its session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable

import psutil


def wait_for(what: str, check: Callable[[], bool], limit: float, every: float = 1.0) -> float:
    """Poll ``check`` every ``every`` seconds until it holds; fails naming ``what`` after ``limit``
    seconds. Returns the seconds it took."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < limit, f"{what}: not within {limit:.0f} s"
        time.sleep(every)
    return time.monotonic() - started


def running(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs (a zombie, or one that is gone, does not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def session_left(session: int) -> list[int]:
    """The processes of ``session`` (a process started with a session of its own) still running."""
    left = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session and running(proc):
                left.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return left


def kill_session(driver: subprocess.Popen) -> None:
    """SIGKILL to ``driver``'s whole session (it was started with one of its own), then reap it."""
    with contextlib.suppress(ProcessLookupError):  # its Dask workers and Prefect server go too
        os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
