"""A user's reward function run in a process of its own, so that nothing it does takes the driver
down, from its import on: a hang ends at ``reward.load_timeout_s`` (the import) or ``reward.timeout_s``
(per call), an exit (``sys.exit``, ``os._exit``) or a kill ends only the worker. It runs apart from
the driver (``nereus_core.rewards.isolation``): its own environment, limits on its address space
(``reward.max_memory``) and CPU seconds (``reward.max_cpu_s``), and what it prints goes to a log file
(``RUN_DIR/logs/reward_worker.log`` for a job's worker, a temp file otherwise; at most
``worker_process.OUTPUT_CHARS`` per import and per call, rotated past ``LOG_MAX_BYTES``), which every
error line names. Each failure is one ``RewardError`` line naming the function; a new worker starts at the
next call. What it returns comes back as is: ``registry.score_text`` checks it.

``load_problem`` is the config's check of a ``path/to/file.py:function``: a short-lived worker
imports the file and checks the function, then ends; the driver never imports it.

Why a process rather than a guarded call in the driver: a thread cannot be stopped, and a function
stuck in C code, calling ``os._exit`` or allocating without bound cannot be guarded in-process. The
price is one pipe round trip per response (about 0.2 ms, beside 0.01 ms in-process;
``benchmarks.bench_bad_input``) and one start per job (a fraction of a second: the worker imports
only the user's file, through ``user_file``, stdlib, not torch).

Boundary: stdlib only (a plain interpreter started with ``subprocess``, pipes read through
``multiprocessing.connection``); built-in rewards never come here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

from nereus_core.rewards import worker_process
from nereus_core.rewards.errors import RewardError
from nereus_core.rewards.isolation import WorkerSettings, child_environment, size_text

LOG_MAX_BYTES = 64 * 2**20  # past this a worker's log is rotated (one old copy kept) at its next start


class _StartFailed(Exception):
    """A worker that did not get ready: one line saying why, without the function's name."""


class RewardWorker:
    """``fn(data_source, solution_str, ground_truth, extra_info)`` of the user's ``spec``, called in a
    worker process run by ``settings``. Callable like the function itself."""

    def __init__(self, spec: str, settings: WorkerSettings | None = None) -> None:
        self.spec, self.settings = spec, settings or WorkerSettings()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None  # answers
        self._requests: Connection | None = None
        self._log: str | None = None  # the log of the worker running now (or of the last one)
        self._temp_log: str | None = None  # a temp log of ours, removed at close unless an error named it

    @property
    def timeout_s(self) -> float:
        return self.settings.timeout_s

    def log_to(self, path: str) -> None:
        """From the next start on, log to ``path`` (its directory made then); ends the worker running
        now, so that everything from here on is in ``path``."""
        self.close()
        self.settings = self.settings.logging_to(os.path.abspath(path))

    def _open_log(self) -> IO[bytes]:
        path = self.settings.log_path
        if path is None:
            fd, path = tempfile.mkstemp(prefix="nereus-reward-worker-", suffix=".log")
            self._log = self._temp_log = path
            return os.fdopen(fd, "ab")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            if os.path.getsize(path) > LOG_MAX_BYTES:
                os.replace(path, f"{path}.1")
        self._log = path
        return open(path, "ab")  # the worker holds it; ours is closed after the start

    def _named(self) -> str:
        """`` (worker log: PATH)``, and the log kept for the user to read."""
        self._temp_log = None
        return f" (worker log: {self._log})"

    def _spawn(self) -> Connection:
        # A plain interpreter rather than multiprocessing's spawn, which would import the driver's
        # __main__ (the CLI and all it imports) into the worker, and an environment built from the
        # config rather than the driver's. Limits are set by the worker itself before it imports the
        # user's file (preexec_fn is unsafe in a driver with threads). It stays in the driver's process
        # group, so that a signal to the group (Ctrl-C, a stop) reaches it too, and it ends by itself
        # within a second of the driver's end (``worker_process``).
        to_worker, from_driver = os.pipe()
        to_driver, from_worker = os.pipe()
        root = str(Path(__file__).resolve().parents[2])  # where nereus_core is importable from
        code = f"import sys; sys.path.insert(0, {root!r}); from {worker_process.__name__} import main; main()"
        s = self.settings
        argv = [sys.executable, "-c", code, str(to_worker), str(from_worker), self.spec]
        argv += [str(s.max_memory), str(int(s.max_cpu_s))]
        with self._open_log() as log:
            proc = subprocess.Popen(
                argv,
                pass_fds=(to_worker, from_worker),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=child_environment(s),
            )
        os.close(to_worker)
        os.close(from_worker)
        self._proc = proc
        self._requests = Connection(from_driver, readable=False)
        self._conn = Connection(to_driver, writable=False)
        return self._conn

    def start(self) -> Connection:
        """Start a worker and wait until it has loaded the function; RewardError in one line if not."""
        try:
            return self._start()
        except _StartFailed as err:
            raise RewardError(f"reward function {self.spec}: {err}") from None

    def _start(self) -> Connection:
        self.close()
        conn, s = self._spawn(), self.settings
        if not conn.poll(s.load_timeout_s):
            self.close(keep_log=True)
            raise _StartFailed(
                f"loading it did not finish within reward.load_timeout_s={s.load_timeout_s:g} s (importing "
                f"the file runs it); make the import quicker or raise reward.load_timeout_s{self._named()}"
            )
        try:
            kind, message, _ = conn.recv()
        except EOFError:
            raise _StartFailed(
                f"its worker ended while loading it ({self._ended()}); a reward file must not exit or "
                f"crash at import{self._named()}"
            ) from None
        if kind != "ready":
            self.close(keep_log=True)
            hint = f"; {self._memory_hint()}" if kind == "no-memory" else ""
            raise _StartFailed(f"{message}{hint}{self._named()}")
        return conn

    def _memory_hint(self) -> str:
        limit = size_text(self.settings.max_memory)
        return f"the worker's address space is limited to reward.max_memory={limit}; raise it if need be"

    def _ended(self) -> str:
        """How the worker ended (it has, or is about to): its exit status or the signal that killed it."""
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        code = proc.returncode if proc is not None else None
        self.close(keep_log=True)
        if code is None:
            return "no exit status"
        if code >= 0:
            return f"exit status {code}"
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGXCPU:
            return f"killed by {name}: past reward.max_cpu_s={self.settings.max_cpu_s} CPU seconds"
        return f"killed by {name}"

    def __call__(self, data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any) -> Any:
        alive = self._proc is not None and self._proc.poll() is None
        conn = self._conn if alive and self._conn is not None else self.start()
        args = (data_source, solution_str, ground_truth, extra_info)
        try:
            assert self._requests is not None
            self._requests.send(args)
        except OSError:  # the worker has gone since its last answer
            conn = self.start()
            assert self._requests is not None
            self._requests.send(args)
        if not conn.poll(self.timeout_s):
            self.close(keep_log=True)
            raise RewardError(
                f"reward function {self.spec} did not return within reward.timeout_s={self.timeout_s:g} s; "
                f"make it faster or raise reward.timeout_s{self._named()}"
            )
        try:
            kind, value, cpu_s = conn.recv()
        except EOFError:
            raise RewardError(
                f"reward function {self.spec} ended its process ({self._ended()}); a reward function "
                f"returns a score, it must not exit{self._named()}"
            ) from None
        if kind == "ok":
            self._recycle(cpu_s)
            return value
        if kind == "exited":
            raise RewardError(
                f"reward function {self.spec} tried to exit the process ({value}); return a score "
                f"instead{self._named()}"
            )
        hint = f"; {self._memory_hint()}" if value.startswith("MemoryError") else ""
        raise RewardError(f"reward function {self.spec} raised {value}{hint}{self._named()}")

    def _recycle(self, cpu_s: float) -> None:
        """End a worker that has used half its CPU seconds, or whose log is past ``LOG_MAX_BYTES``: the
        next call starts a fresh one, so that steady use never reaches a limit."""
        try:
            big = self._log is not None and os.path.getsize(self._log) > LOG_MAX_BYTES
        except OSError:
            big = False
        if big or cpu_s > self.settings.max_cpu_s / 2:
            self.close()

    def close(self, *, keep_log: bool = False) -> None:
        """End the worker (killed: it may be stuck); the next call starts a new one. A temp log goes
        too, unless ``keep_log`` or an error line has named it."""
        for conn in (self._conn, self._requests):
            if conn is not None:
                conn.close()
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        if self._temp_log is not None and not keep_log:
            with contextlib.suppress(OSError):
                os.unlink(self._temp_log)
            self._temp_log = None
        self._proc, self._conn, self._requests = None, None, None

    def __reduce__(self) -> Any:  # a copy elsewhere starts its own worker
        return (RewardWorker, (self.spec, self.settings))


def load_problem(spec: str, settings: WorkerSettings) -> str | None:
    """Why the user's ``spec`` cannot be loaded (the import hangs, exits, raises or runs out of
    memory; the function is missing, not callable or takes other arguments), found by a worker of
    its own that ends right after; None if it loads. The driver never imports the file."""
    worker = RewardWorker(spec, settings)
    try:
        worker._start()
    except _StartFailed as err:
        return str(err)
    finally:
        worker.close()
    return None


__all__ = ["LOG_MAX_BYTES", "RewardWorker", "load_problem"]
