"""How a ``nereus`` command that runs a flow stops on SIGTERM or SIGINT: within seconds, once.

    signal --> Stopped (or Prefect's TerminationSignal inside a flow) unwinds the driver:
               the device pool and the sweep cluster close in their ``with`` blocks
           --> finish(): one line (what stopped, where to continue), every child process
               (Prefect's temporary server, Dask processes, the watchdog) terminated, then
               killed after ``KILL_AFTER_S``, and the process exits 128 + the signal's number
    deadline: ``GRACE_S`` after the signal, finish() runs from a thread of its own if the
              unwinding has not got there (a task thread that cannot be interrupted, a server
              that no longer answers), so that a second signal is never needed

Inside a flow run Prefect replaces the SIGTERM handler with its own, which raises
``TerminationSignal`` and, when a Prefect runner cancels the run, marks it Cancelled rather than
Crashed. The deadline therefore does not hang on any Python handler: ``signal.set_wakeup_fd``
makes the interpreter write the number of every handled signal to a socket, whoever's handler
runs, and a thread reading that socket starts the clock. The exit skips the interpreter's own
shutdown (``os._exit``): Prefect's services drain their queues to the server at exit and would
wait for one that is stopping or already gone (for minutes, logging "Still processing items").
Whatever a run has committed to disk stays the resume point, as after a SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import NoReturn

import psutil

from flows.cli.watchdog import terminate_then_kill

GRACE_S = 6.0  # signal -> finish() at the latest; closing a LocalCluster takes about 1-5 s
KILL_AFTER_S = 2.0  # SIGTERM -> SIGKILL of a child process still running
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """Raised in the main thread by the first SIGTERM or SIGINT outside a flow run's own handler.

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` of a task or a flow
    mistakes it for a failure of its own and goes on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    signum: int | None = None
    line: Callable[[], str] = staticmethod(lambda: "stopped")
    lock = threading.Lock()
    finishing = False
    installed = False


def signalled() -> int | None:
    """The signal this driver is stopping on, or None."""
    return _State.signum


def stopped_by(err: BaseException) -> int | None:
    """The signal an exception out of a command stands for, or None: ours, Prefect's
    ``TerminationSignal``, Ctrl-C once ``install`` has run, or any error after a signal (the
    unwinding that a stop caused, a Dask call cut off)."""
    if isinstance(err, Stopped):
        return err.signum
    number = getattr(err, "signal", None)  # prefect.exceptions.TerminationSignal, a BaseException
    if not isinstance(err, Exception) and isinstance(number, int):
        return number
    if _State.signum is not None:
        return _State.signum
    return signal.SIGINT if isinstance(err, KeyboardInterrupt) and _State.installed else None


def _handler(signum: int, frame: FrameType | None) -> None:
    if _State.signum is not None:
        return  # already stopping: a later signal (or Prefect's own re-raise) changes nothing
    _State.signum = signum
    raise Stopped(signum)


def _watch(sock: socket.socket) -> None:
    """Start the deadline on the first SIGTERM or SIGINT the interpreter reports."""
    while True:
        try:
            data = sock.recv(64)
        except OSError:
            return
        if not data:  # the writer closed (a later install replaced it): recv returns b"" at once, forever
            return
        got = [n for n in data if n in SIGNALS]
        if got:
            if _State.signum is None:
                _State.signum = got[0]
            timer = threading.Timer(GRACE_S, finish, kwargs={"signum": got[0], "late": True})
            timer.daemon = True
            timer.start()
            return


def install(line: Callable[[], str]) -> None:
    """Stop this driver on SIGTERM or SIGINT; ``line()`` says what was stopped and where to continue.
    Call from the main thread before the flow starts."""
    _State.line, _State.installed = line, True
    for signum in SIGNALS:
        signal.signal(signum, _handler)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    _State.sockets = (reader, writer)  # type: ignore[attr-defined]  # kept open for the process's life
    threading.Thread(target=_watch, args=(reader,), name="nereus-stop-deadline", daemon=True).start()


def _resume_hint(out: Path, config: Path | None) -> str:
    """Where a stopped run continues: its newest checkpoint, or a new start when it has none."""
    from storage.run_dir import RunDir

    try:
        point = RunDir(out).latest_checkpoint() if (out / "config.yaml").exists() else None
    except (OSError, ValueError):
        point = None
    if point is None:
        again = f"nereus run {config} --out {out}" if config else f"nereus resume {out}"
        return f"no checkpoint yet; start it again with {again}"
    return f"its checkpoint of step {point['step']} is the resume point; continue with nereus resume {out}"


def install_for_run(name: str, out: Path, config: Path | None) -> None:
    """``install`` for ``nereus run`` (``config``: its CONFIG) or ``nereus resume`` (None)."""
    install(lambda: f"run {name} in {out}; {_resume_hint(out, config)}")


def install_for_sweep(name: str, runs: int, out: Path, config: Path) -> None:
    """``install`` for ``nereus simulate CONFIG --out DIR`` of ``runs`` runs."""
    from storage.sim_dir import SimDir

    install(
        lambda: (
            f"simulation {name}, {len(SimDir(out).finished())} of {runs} runs kept in {out}; "
            f"run the rest with nereus simulate {config} --out {out}"
        )
    )


def stop_children(kill_after: float = KILL_AFTER_S) -> list[int]:
    """SIGTERM to every descendant of this process, SIGKILL to those still running ``kill_after``
    seconds later; the pids."""
    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    terminate_then_kill(procs, grace=kill_after)
    return [p.pid for p in procs]


def finish(signum: int | None = None, *, late: bool = False) -> NoReturn:
    """Say what stopped, stop every child process, and exit 128 + ``signum`` now."""
    signum = signum or _State.signum or signal.SIGTERM
    _State.signum = _State.signum or signum
    with _State.lock:
        if _State.finishing:  # the main thread and the deadline: whichever comes first exits
            threading.Event().wait()
        _State.finishing = True
    logging.disable(logging.CRITICAL)  # Prefect and Dask log their own teardown errors from here on
    try:
        text = _State.line()
    except Exception as err:  # the line reads the run directory: never let that keep us running
        text = f"stopped ({err})"
    name = signal.Signals(signum).name
    how = f" after {GRACE_S:g} s of unwinding" if late else ""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        print(f"nereus: stopped by {name}{how}: {text}", file=sys.stderr, flush=True)
        devnull = os.open(os.devnull, os.O_WRONLY)  # the line is the last word: threads still logging
        os.dup2(devnull, sys.stdout.fileno())  # (Prefect's services, Dask's comms) say nothing more
        os.dup2(devnull, sys.stderr.fileno())
    stop_children()
    os._exit(128 + signum)


def on_exception(err: BaseException) -> int:
    """What a command that raised ``err`` ends with: a stop by a signal ends the process (``finish``);
    Ctrl-C outside a flow exits 130; anything else is raised again."""
    signum = stopped_by(err)
    if signum is not None:
        finish(signum)
    if isinstance(err, KeyboardInterrupt):
        print("nereus: interrupted", file=sys.stderr)
        return 130
    raise err
