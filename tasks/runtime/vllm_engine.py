"""A vLLM rollout engine as a device actor holds it, and the device functions the pool runs.

    start_engine   (the replica's first device)  starts its engine process (tasks/runtime/vllm_host.py)
    write_slices   (actor/train replica 0)       its parameter slices -> one safetensors file in /dev/shm
    reload_engine  (the replica's first device)  the engine reloads in place from those files
    engine_generate                               prompts as token ids -> ids and log-probs [b, T]
    stop_engine                                   the process exits

Every request has a deadline (the driver computes it from the work: rollout's settings); an engine
that misses one is killed with whatever it started, and so is one whose start or weight load
failed: it stays behind as its failure, so nothing generates on half-replaced weights.

Boundary: the process and its environment (the variables vLLM reads are set here, for the child
only); what is asked and how answers become tensors is ``nereus_core.engine.sampling``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import psutil  # a dependency of distributed
import torch
from safetensors.torch import save_file

from nereus_core.engine import sampling
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.shard import get_shard

ROOT = Path(__file__).resolve().parents[2]
# What the device actor set for DeepSpeed's world: the engine builds a world of its own.
WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
TAIL_CHARS = 2000
POLL_S = 0.5  # how often a wait looks whether the engine process exited
CLOSE_TIMEOUT_S = 10.0  # a healthy engine answers close at once
EXIT_TIMEOUT_S = 30.0  # and exits once vLLM has torn down
# The rollout settings that bound each request, named in the line that reports a missed deadline.
DEADLINE_SETTINGS = {
    "start": "rollout.start_timeout_s",
    "generate": "rollout.generate_timeout_s + rollout.generate_timeout_s_per_token x tokens",
    "reload": "rollout.sync_timeout_s + rollout.sync_timeout_s_per_gib x GiB",
    "close": f"fixed {CLOSE_TIMEOUT_S:.0f} s",
}


class EngineDied(RuntimeError):
    """The engine process of a replica exited or failed a request."""


class EngineTimeout(EngineDied):
    """The engine process of a replica gave no answer within its request's deadline; it was killed."""


class EngineProcess:
    """One vLLM engine process and the connection to it. Every request has a deadline: a stopped or
    deadlocked engine stays alive (so does the job's heartbeat), and only a deadline ends the wait."""

    def __init__(self, what: str, cores: str, log_path: Path, *, deadline_s: float) -> None:
        """Start the process; it must connect within ``deadline_s`` seconds (its share of the start's)."""
        self.what = what
        self.log_path = log_path
        listener = Listener(("127.0.0.1", 0), authkey=(key := secrets.token_bytes(16)))
        env = {k: v for k, v in os.environ.items() if k not in WORLD_VARIABLES}
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine core in this process: seconds, not a minute
            VLLM_CPU_OMP_THREADS_BIND=cores,
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        )
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tasks.runtime.vllm_host"],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
        )
        hello = {"address": list(listener.address), "authkey": key.hex(), "parent": os.getpid()}
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(hello) + "\n").encode())
        self.proc.stdin.close()
        try:
            self.conn = self._accept(listener, deadline_s)
        except EngineDied:
            self._log.close()
            raise

    def _accept(self, listener: Listener, deadline_s: float) -> Connection:
        got: list[Connection] = []
        thread = threading.Thread(target=lambda: got.append(listener.accept()), daemon=True)
        thread.start()
        until = time.monotonic() + deadline_s
        while thread.is_alive() and time.monotonic() < until:
            thread.join(min(POLL_S, max(0.0, until - time.monotonic())))
            if self.proc.poll() is not None:
                break
        listener.close()
        if got:
            return got[0]
        if self.proc.poll() is None:
            self.kill()
            raise self._timed_out("start", deadline_s)
        raise self._died("did not connect")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, op: str, *, deadline_s: float, since: float | None = None, **kwargs: Any) -> Any:
        """Send one request and wait for its answer at most ``deadline_s`` seconds (counted from the
        monotonic time ``since``, default now); an engine that exits fails in one line naming it, one
        that does not answer in time is killed and fails in one line naming it and the deadline.

        The exchange runs in a thread of its own: a stopped engine can block the send itself (a full
        pipe) or the receipt of a half-written answer, and only killing the process frees them."""
        until = (time.monotonic() if since is None else since) + deadline_s
        got: list[tuple[str, Any]] = []

        def exchange() -> None:
            try:
                self.conn.send((op, kwargs))
                got.append(("answer", self.conn.recv()))
            except Exception as exc:  # EOF, a broken pipe, a socket the kill closed
                got.append(("lost", exc))

        thread = threading.Thread(target=exchange, daemon=True, name=f"vllm-engine-{op}")
        thread.start()
        while thread.is_alive():
            thread.join(min(POLL_S, max(0.0, until - time.monotonic())))
            if not thread.is_alive():
                break
            if self.proc.poll() is not None:
                thread.join(POLL_S)  # an answer it wrote before it exited is still read
                if thread.is_alive() or not got or got[0][0] != "answer":
                    raise self._died(f"exited during {op}")
            elif time.monotonic() >= until:
                self.kill()
                raise self._timed_out(op, deadline_s)
        how, answer = got[0] if got else ("lost", None)
        if how != "answer":
            raise self._died(f"lost during {op} ({type(answer).__name__})") from None
        status, result = answer
        if status != "ok":
            raise EngineDied(f"{self.what} (pid {self.proc.pid}) failed {op}: {result}")
        return result

    def kill(self) -> None:
        """SIGKILL to the process and whatever it started (a stopped process dies of it too)."""
        try:
            below = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            below = []
        for proc in below:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Ask the process to exit; one that does not answer or exit in time is killed."""
        if self.alive:
            try:
                self.ask("close", deadline_s=CLOSE_TIMEOUT_S)
                self.proc.wait(EXIT_TIMEOUT_S)
            except (EngineDied, subprocess.TimeoutExpired):
                self.kill()
        self.conn.close()
        self._log.close()

    def _died(self, how: str) -> EngineDied:
        code = self.proc.poll()
        tail = self.log_path.read_text(errors="replace")[-TAIL_CHARS:] if self.log_path.exists() else ""
        last = [line for line in tail.splitlines() if line.strip()][-1:] or ["(no output)"]
        return EngineDied(
            f"{self.what} (pid {self.proc.pid}) {how}, exit code {code}; last line: {last[0]} "
            f"(log: {self.log_path})"
        )

    def _timed_out(self, op: str, deadline_s: float) -> EngineTimeout:
        return EngineTimeout(
            f"{self.what} (pid {self.proc.pid}) gave no answer to {op} within its deadline of "
            f"{deadline_s:.1f} s ({DEADLINE_SETTINGS.get(op, 'fixed')}) and was killed: the process was "
            "stopped, deadlocked or blocked; if it is only slow, raise that setting"
        )


def _key(name: str) -> str:
    return f"vllm/{name}"


def engine(ctx: DeviceContext, name: str) -> EngineProcess:
    held = ctx.resident.get(_key(name))
    if isinstance(held, EngineDied):  # killed after a failed request: never asked again
        raise EngineDied(f"{held}; start the engines again")
    if not isinstance(held, EngineProcess):
        raise RuntimeError(f"no vLLM engine of {name} on device {ctx.rank}; start it first")
    return held


def _ask(ctx: DeviceContext, name: str, op: str, *, keep_on_error: bool, **kwargs: Any) -> Any:
    """``op`` of this device's engine of ``name``. An engine that failed and is not ``keep_on_error``
    (a start or a weight load: its weights may be half replaced), or that exited or was killed, is
    stopped and left behind as its failure, so that nothing generates on it again."""
    proc = engine(ctx, name)
    try:
        return proc.ask(op, **kwargs)
    except Exception as err:
        if not (keep_on_error and proc.alive):
            first = str(err).splitlines()[0]
            ctx.resident[_key(name)] = EngineDied(f"{first.rstrip('.')} ({op} failed, engine stopped)")
            if proc.alive:
                proc.kill()
            proc.close()
        raise


def start_engine(
    ctx: DeviceContext,
    *,
    name: str,
    replica: int,
    cores: str,
    settings: dict[str, Any],
    deadline_s: float,
) -> float:
    """Start replica ``replica``'s engine of ``name`` on this device (its first slot) within
    ``deadline_s`` seconds; returns seconds."""
    start = time.perf_counter()
    since = time.monotonic()
    stop_engine(ctx, name=name)
    work = Path(settings["work_dir"]) / f"replica{replica}"
    what = f"vLLM engine of {name} replica {replica} (device {ctx.rank})"
    proc = EngineProcess(what, cores, work / "engine.log", deadline_s=deadline_s)
    ctx.resident[_key(name)] = proc
    settings = {**settings, "work_dir": str(work)}
    _ask(ctx, name, "start", keep_on_error=False, deadline_s=deadline_s, since=since, **settings)
    return time.perf_counter() - start


def stop_engine(ctx: DeviceContext, *, name: str) -> None:
    held = ctx.resident.pop(_key(name), None)
    if isinstance(held, EngineProcess):
        held.close()


def write_slices(ctx: DeviceContext, *, name: str, directory: str) -> str:
    """This device's parameter slices of ``name`` as one safetensors file in ``directory``; its path."""
    path = Path(directory) / f"{name.replace('/', '-')}-device{ctx.rank}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    # the live parameters, not a clone: save_file copies them into the file once; a tied head is the
    # embedding's tensor, written once (the engine ties it again)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    held = get_shard(ctx, name).local_state()
    for key in sorted(held, key=lambda k: k == "lm_head.weight"):  # the head last: the embedding stays
        value = held[key]
        if value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            tensors[key] = value.detach().cpu().contiguous()
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return str(path)


def reload_engine(
    ctx: DeviceContext,
    *,
    name: str,
    files: list[str],
    layout_json: str,
    config_json: str,
    deadline_s: float,
) -> dict[str, float]:
    """The engine of ``name`` on this device reloads its weights in place from ``files`` within
    ``deadline_s`` seconds; one that fails or misses it is stopped (its weights may be half new)."""
    return _ask(
        ctx,
        name,
        "reload",
        keep_on_error=False,
        deadline_s=deadline_s,
        files=files,
        layout_json=layout_json,
        config_json=config_json,
    )


def engine_generate(
    ctx: DeviceContext,
    prompts_bs: torch.Tensor,
    prompt_mask_bs: torch.Tensor | None,
    *,
    name: str,
    request: sampling.SamplingRequest,
    group: int,
    row_offset: int,
    pad_id: int,
    deadline_s: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's responses ``[b, T]`` and the engine's log-probs of them ``[b, T]``, within
    ``deadline_s`` seconds."""
    rows = sampling.prompt_lists(prompts_bs, prompt_mask_bs)
    # vLLM samples n > 1 only with a temperature; greedy copies are asked one by one (the prefix
    # cache shares their prompt)
    firsts = sampling.distinct_prompts(rows, group) if request.temperature > 0 else None
    asked, n = (firsts, group) if firsts is not None else (rows, 1)
    per = dict(request.__dict__, n=n)
    params = [sampling.SamplingRequest(**per).params(row_offset + i * n) for i in range(len(asked))]
    answers = _ask(
        ctx, name, "generate", keep_on_error=True, deadline_s=deadline_s, prompts=asked, params=params
    )
    samples = [sample for prompt in answers for sample in prompt]
    return sampling.response_tensors(samples, request.max_new_tokens, pad_id)
