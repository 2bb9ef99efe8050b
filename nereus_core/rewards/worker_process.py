"""What runs inside a reward worker process (``nereus_core.rewards.worker`` starts it): limits set
first, then the user's file imported and its function checked, then one answer per call. What the
user's code prints goes to the worker's log, at most ``OUTPUT_CHARS`` characters per import and per
call (the rest is counted and dropped: megabytes printed per response cost neither time nor disk).

Boundary: stdlib only, so that a worker starts without the rest of Nereus (torch and all).
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, TextIO

from nereus_core.rewards.isolation import apply_limits
from nereus_core.rewards.user_file import first_line, load_function

OUTPUT_CHARS = 2**20  # of stdout and stderr together, per import and per call


class _Capped(io.TextIOBase):
    """A text stream passing on at most ``left`` characters (shared by stdout and stderr through
    ``budget``) and counting the rest."""

    def __init__(self, inner: TextIO, budget: dict[str, int]) -> None:
        self.inner, self.budget = inner, budget

    def write(self, text: str) -> int:
        kept = text[: max(self.budget["left"], 0)]
        if kept:
            self.inner.write(kept)
        self.budget["left"] -= len(kept)
        self.budget["dropped"] += len(text) - len(kept)
        return len(text)

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.inner.encoding

    @property
    def buffer(self) -> Any:  # bytes written here bypass the cap, as C code writing to fd 1 does
        return self.inner.buffer


def _end_of_part(budget: dict[str, int], what: str) -> None:
    """Flush, note what was dropped, and give the next import or call its own budget."""
    sys.stdout.flush()
    if budget["dropped"]:
        sys.__stderr__.write(
            f"[nereus: {budget['dropped']:,} more characters printed by the {what} were dropped; "
            f"at most {OUTPUT_CHARS:,} per import and per call reach this log]\n"
        )
    sys.stderr.flush()
    budget.update(left=OUTPUT_CHARS, dropped=0)


def _serve(requests: Connection, answers: Connection, spec: str) -> None:
    """The worker's loop: load ``spec``, then answer each call with (kind, value, CPU seconds used)."""
    budget = {"left": OUTPUT_CHARS, "dropped": 0}
    sys.stdout, sys.stderr = _Capped(sys.stdout, budget), _Capped(sys.stderr, budget)
    try:
        fn = load_function(spec)
    except ValueError as err:
        traceback.print_exception(err.__context__ or err)  # into the log, in full
        _end_of_part(budget, "import")
        kind = "no-memory" if isinstance(err.__context__, MemoryError) else "failed"
        answers.send((kind, str(err), time.process_time()))
        return
    _end_of_part(budget, "import")
    answers.send(("ready", None, time.process_time()))
    while True:
        try:
            args = requests.recv()
        except EOFError:  # the driver has gone
            return
        try:
            answer: tuple[str, Any] = ("ok", fn(*args))
        except SystemExit as err:
            answer = ("exited", f"SystemExit({err.code!r})")
        except BaseException as err:  # the user's code: anything, named, its traceback in the log
            traceback.print_exc()
            answer = ("raised", f"{type(err).__name__}: {first_line(err)}")
        _end_of_part(budget, "call")
        try:
            answers.send((*answer, time.process_time()))
        except Exception as err:  # e.g. a value that cannot be pickled
            message = f"returned {type(answer[1]).__name__}, which cannot be sent back: {err}"
            answers.send(("raised", message, time.process_time()))


def _end_when_orphaned(driver: int) -> None:
    """End this worker within a second of its driver's end (it is re-parented then), even in the
    middle of a call or an import that hangs: a worker never outlives its driver."""
    while os.getppid() == driver:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    """The worker process; its arguments: READ_FD WRITE_FD SPEC MAX_MEMORY MAX_CPU_S
    (``RewardWorker._spawn``). The limits hold before the user's file is imported."""
    argv = sys.argv[1:]
    threading.Thread(target=_end_when_orphaned, args=(os.getppid(),), daemon=True).start()
    apply_limits(int(argv[3]), int(argv[4]))
    _serve(Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False), argv[2])


__all__ = ["OUTPUT_CHARS", "main"]
