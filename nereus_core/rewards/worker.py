"""A user's reward function run in a process of its own, so that nothing it does takes the driver
down: a hang ends at ``reward.timeout_s`` per call, an exit (``sys.exit``, ``os._exit``) ends only
the worker, and what it prints goes nowhere (its stdout and stderr are ``/dev/null``). Each is one
``RewardError`` line naming the function; a new worker starts at the next call. What it returns
comes back as is: ``registry.score_text`` checks it (NaN, inf, a string, a dict without ``score``).

Why a process rather than a guarded call in the driver: a thread cannot be stopped, and a function
stuck in C code or calling ``os._exit`` cannot be guarded in-process. The price is one pipe round
trip per response (about 0.2 ms, beside 0.01 ms in-process; ``benchmarks.bench_bad_input``) and one
start per job (under a second: the worker imports only the user's file, through ``user_file``,
stdlib, not torch).

Boundary: stdlib only (a plain interpreter started with ``subprocess``, pipes read through
``multiprocessing.connection``); built-in rewards never come here.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from nereus_core.rewards.errors import RewardError
from nereus_core.rewards.user_file import first_line, load_function

START_S = 120.0  # the worker's start and the user's import; not the per-call limit


def _serve(requests: Connection, answers: Connection, spec: str) -> None:
    """The worker's loop: load ``spec``, then answer each call with ("ok", value) or what went wrong."""
    try:
        fn = load_function(spec)
    except ValueError as err:
        answers.send(("failed", str(err)))
        return
    answers.send(("ready", None))
    while True:
        try:
            args = requests.recv()
        except EOFError:  # the driver has gone
            return
        try:
            answer: tuple[str, Any] = ("ok", fn(*args))
        except SystemExit as err:
            answer = ("exited", f"SystemExit({err.code!r})")
        except BaseException as err:  # the user's code: anything, named
            answer = ("raised", f"{type(err).__name__}: {first_line(err)}")
        try:
            answers.send(answer)
        except Exception as err:  # e.g. a value that cannot be pickled
            answers.send(("raised", f"returned {type(answer[1]).__name__}, which cannot be sent back: {err}"))


def main() -> None:
    """The worker process; its arguments: READ_FD WRITE_FD SPEC (``RewardWorker._start``)."""
    argv = sys.argv[1:]
    _serve(Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False), argv[2])


class RewardWorker:
    """``fn(data_source, solution_str, ground_truth, extra_info)`` of the user's ``spec``, called in a
    worker process with ``timeout_s`` per call. Callable like the function itself."""

    def __init__(self, spec: str, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None  # answers
        self._requests: Connection | None = None

    def _start(self) -> Connection:
        # A plain interpreter rather than multiprocessing's spawn, which would import the driver's
        # __main__ (the CLI and all it imports) into the worker. Its stdout and stderr are /dev/null;
        # requests and answers go over two pipes.
        to_worker, from_driver = os.pipe()
        to_driver, from_worker = os.pipe()
        root = str(Path(__file__).resolve().parents[2])  # where nereus_core is importable from
        code = (
            f"import sys; sys.path.insert(0, {root!r}); from nereus_core.rewards.worker import main; main()"
        )
        argv = [sys.executable, "-c", code, str(to_worker), str(from_worker), self.spec]
        null = subprocess.DEVNULL
        proc = subprocess.Popen(argv, pass_fds=(to_worker, from_worker), stdin=null, stdout=null, stderr=null)
        os.close(to_worker)
        os.close(from_worker)
        self._proc = proc
        self._requests = Connection(from_driver, readable=False)
        self._conn = Connection(to_driver, writable=False)
        if not self._conn.poll(START_S):
            self.close()
            raise RewardError(f"reward function {self.spec}: its worker did not start within {START_S:.0f} s")
        try:
            kind, message = self._conn.recv()
        except EOFError:
            code = self._ended()
            raise RewardError(f"reward function {self.spec}: its worker ended at start ({code})") from None
        if kind != "ready":
            self.close()
            raise RewardError(f"reward function {self.spec}: {message}")
        return self._conn

    def _ended(self) -> str:
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self.close()
        return f"exit status {proc.returncode}" if proc is not None else "no process"

    def __call__(self, data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any) -> Any:
        alive = self._proc is not None and self._proc.poll() is None
        conn = self._conn if alive and self._conn is not None else self._start()
        assert self._requests is not None
        try:
            self._requests.send((data_source, solution_str, ground_truth, extra_info))
        except OSError:  # the worker has gone since its last answer
            conn = self._start()
            self._requests.send((data_source, solution_str, ground_truth, extra_info))
        if not conn.poll(self.timeout_s):
            self.close()
            raise RewardError(
                f"reward function {self.spec} did not return within reward.timeout_s={self.timeout_s:g} s; "
                "make it faster or raise reward.timeout_s"
            )
        try:
            kind, value = conn.recv()
        except EOFError:
            raise RewardError(
                f"reward function {self.spec} ended its process ({self._ended()}); a reward function "
                "returns a score, it must not exit"
            ) from None
        if kind == "exited":
            raise RewardError(
                f"reward function {self.spec} tried to exit the process ({value}); return a score instead"
            )
        if kind == "raised":
            raise RewardError(f"reward function {self.spec} raised {value}")
        return value

    def close(self) -> None:
        """End the worker (killed: it may be stuck); the next call starts a new one."""
        for conn in (self._conn, self._requests):
            if conn is not None:
                conn.close()
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
        self._proc, self._conn, self._requests = None, None, None

    def __reduce__(self) -> Any:  # a copy elsewhere starts its own worker
        return (RewardWorker, (self.spec, self.timeout_s))


__all__ = ["START_S", "RewardWorker"]
