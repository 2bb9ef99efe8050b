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


def descendants(pid: int) -> list[psutil.Process]:
    """Every process below ``pid`` now (psutil remembers each one's start time: a reused pid is not it)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def stop_and_time(driver: subprocess.Popen, *, group: bool = False, limit: float = 30.0) -> float:
    """SIGTERM to ``driver`` (``group``: to its whole process group, as ``timeout`` sends it); the
    seconds until it exited. Fails if it runs ``limit`` seconds after the signal."""
    started = time.monotonic()
    if group:
        os.killpg(driver.pid, signal.SIGTERM)
    else:
        driver.send_signal(signal.SIGTERM)
    try:
        driver.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {limit:.0f} s after SIGTERM") from None
    return time.monotonic() - started
