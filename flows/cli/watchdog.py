"""Ends what a ``nereus`` driver started once the driver itself is gone, even after ``kill -9``.

A local run's driver starts Prefect's temporary server and the Dask workers as its child processes.
Prefect stops its server from an ``atexit`` hook and exposes no way to tie the server's life to its
parent's, so a driver killed outright leaves the server running as an orphan. The
watchdog is a separate small process, in its own session so that a signal to the driver's terminal
group does not reach it: it keeps a list of the driver's descendants and, when the driver has
exited for any reason, asks each one still running to stop (SIGTERM), then kills what is left after
a grace period, and exits. It imports only psutil and the standard library: it must start fast and
never hold the driver's terminal or pipes.

    driver --spawns--> python -m flows.cli.watchdog DRIVER_PID   (own session, stdio closed)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil

POLL_SECONDS = 0.5  # how often the driver's descendants are listed; the server lives for the whole run
GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL of a descendant left behind


def start_watchdog(pid: int | None = None) -> subprocess.Popen[bytes]:
    """Start the watchdog of process ``pid`` (default: this one); it exits on its own after that
    process does."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli.watchdog", str(pid or os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the driver's process group: Ctrl-C reaches the driver only
        close_fds=True,
    )


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:  # it exited between two looks
        return []


def _alive(proc: psutil.Process) -> bool:
    try:  # a killed child stays a zombie until its parent reaps it: it has exited all the same
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch(pid: int, *, poll: float = POLL_SECONDS, grace: float = GRACE_SECONDS) -> list[int]:
    """Wait for process ``pid`` to exit, then stop every descendant of it seen while it ran that is
    still running; the pids stopped."""
    try:
        driver = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    me = os.getpid()
    seen: dict[int, psutil.Process] = {}
    while _alive(driver):
        for proc in _descendants(driver):
            if proc.pid != me:
                seen[proc.pid] = proc  # psutil.Process remembers its start time: a reused pid is not it
        time.sleep(poll)
    return _stop([proc for proc in seen.values() if proc.is_running()], grace=grace)


def _stop(procs: Sequence[psutil.Process], *, grace: float) -> list[int]:
    # an orphan's own children (the server's worker processes) were reparented but are theirs still
    every = {proc.pid: proc for proc in procs}
    for proc in procs:
        every.update({child.pid: child for child in _descendants(proc)})
    terminate_then_kill([proc for proc in every.values() if proc.pid != os.getpid()], grace=grace)
    return sorted(every)


def terminate_then_kill(procs: Sequence[psutil.Process], *, grace: float) -> None:
    """SIGTERM to each of ``procs``, SIGKILL to those still running ``grace`` seconds later."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m flows.cli.watchdog PID", file=sys.stderr)
        return 2
    watch(int(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
