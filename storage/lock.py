"""The run-directory lock: at most one driver (``nereus run`` or ``nereus resume``) per run directory.

``run_lock(root)`` holds an exclusive ``fcntl.flock`` on ``<root>/.lock`` for the length of
a ``with`` block and writes the holder's pid, host and start time into the file, so that a
second driver is refused with one line naming the first. The kernel drops a flock when
the process holding it dies (SIGKILL included), so a lock file left behind by a dead
driver holds no lock: the next driver takes it over and rewrites its contents. The file
is never deleted (unlinking a flock'd file lets two processes lock two different inodes).

Boundary: one advisory lock between cooperating Nereus processes on one machine's file
system (flock is not reliable on every network file system). The descriptor is opened
close-on-exec, so processes spawned while it is held (Dask workers) do not inherit it;
a process forked without exec would, and would keep the lock until it exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".lock"


class RunLocked(RuntimeError):
    """Another live process holds the run directory's lock; the message names it."""


def _lock_path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / LOCK_FILE


def _describe(text: str) -> str:
    """``pid P on HOST since TIME`` from the lock file's contents (the holder may be mid-write)."""
    try:
        holder = json.loads(text)
        return f"pid {int(holder['pid'])} on {holder['host']} since {holder['since']}"
    except (ValueError, KeyError, TypeError):
        return "another process"


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode("utf-8", errors="replace")


def _write_holder(fd: int) -> None:
    """Replace the file's contents with this process's identity, durably."""
    since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n"
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, text.encode())
    os.fsync(fd)


@contextlib.contextmanager
def run_lock(root: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``<root>/.lock`` (creating ``root`` if missing) for the block; raise ``RunLocked`` at once if
    another live process holds it. Not re-entrant: a second ``run_lock`` on the same root in the same
    process is refused too (flock locks belong to the open file, not to the process)."""
    path = _lock_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            raise RunLocked(
                f"{root} is in use by {holder}; wait for it to finish or choose another --out"
            ) from None
        _write_holder(fd)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def lock_holder(root: str | os.PathLike[str]) -> str | None:
    """``pid P on HOST since TIME`` of the live process holding ``root``'s lock, or None if it is free.

    A probe: it takes a shared lock for an instant and drops it, so it never blocks and never
    takes over a lock; a driver starting in that instant is refused as if the prober held it."""
    path = _lock_path(root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe(_read(fd))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
