"""flows/cli/stopping.py's signal watcher in one process that installs the stop more than once (the
CLI's commands called in process, as tests do): a watcher whose socket a later install replaced ends,
instead of reading end-of-file in a busy loop for the rest of the process."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from flows.cli import stopping


def _cpu_ticks(thread: threading.Thread) -> int:
    """User + system clock ticks a thread of this process has run (Linux's /proc)."""
    stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _watchers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "nereus-stop-deadline"}


def test_a_replaced_watcher_ends() -> None:
    handlers = {s: signal.getsignal(s) for s in stopping.SIGNALS}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    state = dict(vars(stopping._State))
    try:
        before = _watchers()
        stopping.install(lambda: "first")
        (first,) = _watchers() - before
        stopping.install(lambda: "second")  # the first socket pair is dropped, its writer closed
        first.join(timeout=5.0)
        assert not first.is_alive(), "the replaced watcher still runs (it spins on end-of-file)"
        (second,) = _watchers() - before
        ticks = _cpu_ticks(second)
        time.sleep(1.0)
        assert second.is_alive() and _cpu_ticks(second) - ticks <= 2  # the new one waits, idle
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(wakeup)
        for k, v in state.items():
            if not k.startswith("__"):
                setattr(stopping._State, k, v)
