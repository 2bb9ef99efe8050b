"""The run-directory lock (storage/lock.py): one driver per run directory, a dead holder's lock taken over."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import storage.lock
from storage.lock import RunLocked, lock_holder, run_lock

# The holder is a separate process that loads storage/lock.py by its path: importing the
# storage package would pull in torch and pyarrow, seconds per process for nothing.
HOLDER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("lock", sys.argv[1])
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
with lock.run_lock(sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lock of ``tmp_path / 'run'`` (killed at the end of the test)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, storage.lock.__file__, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_process_is_refused_with_one_line_naming_the_holder(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    root = tmp_path / "run"
    with pytest.raises(RunLocked) as refused, run_lock(root):
        pass
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{root} is in use by pid {holder.pid} on {socket.gethostname()} since ")
    assert message.endswith("; wait for it to finish or choose another --out")
    assert lock_holder(root) == message.split(" is in use by ")[1].split("; wait")[0]


def test_the_lock_of_a_killed_holder_is_taken_over(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    root = tmp_path / "run"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert f'"pid": {holder.pid}' in (root / ".lock").read_text()  # the dead holder's file stays
    assert lock_holder(root) is None
    with run_lock(root):
        assert f"pid {os.getpid()} on " in lock_holder(root)  # type: ignore[operator]
        assert f'"pid": {os.getpid()}' in (root / ".lock").read_text()


def test_the_lock_is_released_when_the_block_exits(tmp_path: Path) -> None:
    root = tmp_path / "new" / "run"
    assert lock_holder(root) is None
    with run_lock(root):  # creates the directory
        assert lock_holder(root) is not None
        with pytest.raises(RunLocked, match="in use by pid"), run_lock(root):
            pass  # not re-entrant, even in the same process
    assert lock_holder(root) is None
    with pytest.raises(ZeroDivisionError), run_lock(root):
        1 / 0  # noqa: B018 - released on an exception too
    assert lock_holder(root) is None
    with run_lock(root):
        pass
