"""A user's reward function run in a process of its own, so that nothing it does takes the driver
down: a hang ends at ``reward.timeout_s`` per call, an exit (``sys.exit``, ``os._exit``) ends only
the worker, and what it prints goes nowhere (its stdout and stderr, the descriptors too, are
``/dev/null``). Each is one ``RewardError`` line naming the function; a new worker starts at the next
call. What it returns comes back as is: ``registry.score_text`` checks it (NaN, inf, a string, a dict
without ``score``).

Why a process rather than a guarded call in the driver: a thread cannot be stopped, and a function
stuck in C code or calling ``os._exit`` cannot be guarded in-process. The price is one pipe round
trip per response (``benchmarks.bench_bad_input`` measures it) and one start per job. The worker
imports only the user's file (``user_file``, stdlib), not torch, so it starts in well under a second.

Boundary: stdlib ``multiprocessing`` (spawn: safe beside the driver's threads); built-in rewards
never come here.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing.connection import Connection
from typing import Any

from nereus_core.rewards.errors import RewardError
from nereus_core.rewards.user_file import first_line, load_function

START_S = 120.0  # the worker's start and the user's import; not the per-call limit


def _silence() -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the worker's whole life
    sys.stderr = sys.stdout


def _serve(conn: Connection, spec: str) -> None:
    """The worker's loop: load ``spec``, then answer each call with ("ok", value) or ("raised", ...)."""
    _silence()
    try:
        fn = load_function(spec)
    except ValueError as err:
        conn.send(("failed", str(err)))
        return
    conn.send(("ready", None))
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            answer: tuple[str, Any] = ("ok", fn(*args))
        except SystemExit as err:
            answer = ("exited", f"SystemExit({err.code!r})")
        except BaseException as err:  # the user's code: anything, named
            answer = ("raised", f"{type(err).__name__}: {first_line(err)}")
        try:
            conn.send(answer)
        except Exception as err:  # e.g. a value that cannot be pickled
            conn.send(("raised", f"returned {type(answer[1]).__name__}, which cannot be sent back: {err}"))


class RewardWorker:
    """``fn(data_source, solution_str, ground_truth, extra_info)`` of the user's ``spec``, called in a
    worker process with ``timeout_s`` per call. Callable like the function itself."""

    def __init__(self, spec: str, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def _start(self) -> Connection:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        proc = context.Process(target=_serve, args=(theirs, self.spec), daemon=True, name="nereus-reward")
        proc.start()
        theirs.close()
        self._proc, self._conn = proc, ours
        if not ours.poll(START_S):
            self.close()
            raise RewardError(f"reward function {self.spec}: its worker did not start within {START_S:.0f} s")
        try:
            kind, message = ours.recv()
        except EOFError:
            code = self._ended()
            raise RewardError(f"reward function {self.spec}: its worker ended at start ({code})") from None
        if kind != "ready":
            self.close()
            raise RewardError(f"reward function {self.spec}: {message}")
        return ours

    def _ended(self) -> str:
        proc = self._proc
        self.close()
        return f"exit status {proc.exitcode}" if proc is not None else "no process"

    def __call__(self, data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any) -> Any:
        conn = self._conn if self._proc is not None and self._proc.is_alive() else self._start()
        assert conn is not None
        conn.send((data_source, solution_str, ground_truth, extra_info))
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
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
        self._proc = self._conn = None

    def __reduce__(self) -> Any:  # a copy elsewhere starts its own worker
        return (RewardWorker, (self.spec, self.timeout_s))


__all__ = ["START_S", "RewardWorker"]
