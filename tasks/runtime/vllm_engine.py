"""A vLLM rollout engine as a device actor holds it, and the device functions the pool runs.

    start_engine   (the replica's first device)  starts its engine process (tasks/runtime/vllm_host.py)
    write_slices   (actor/train replica 0)       its parameter slices -> one safetensors file in /dev/shm
    reload_engine  (the replica's first device)  the engine reloads in place from those files
    engine_generate                               prompts as token ids -> ids and log-probs [b, T]
    stop_engine                                   the process exits

Boundary: the process and its environment (the variables vLLM reads are set here, for the child
only); what is asked and how answers become tensors is ``nereus_core.engine.sampling``'s.
"""

from __future__ import annotations

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

import torch
from safetensors.torch import save_file

from nereus_core.engine import sampling
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.shard import get_shard

ROOT = Path(__file__).resolve().parents[2]
# What the device actor set for DeepSpeed's world: the engine builds a world of its own.
WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
START_TIMEOUT_S = 900.0
TAIL_CHARS = 2000


class EngineDied(RuntimeError):
    """The engine process of a replica exited or failed a request."""


class EngineProcess:
    """One vLLM engine process and the connection to it."""

    def __init__(self, what: str, cores: str, log_path: Path) -> None:
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
        self.conn = self._accept(listener)

    def _accept(self, listener: Listener) -> Connection:
        got: list[Connection] = []
        thread = threading.Thread(target=lambda: got.append(listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.5)
            if self.proc.poll() is not None:
                break
        listener.close()
        if not got:
            raise self._died("did not connect")
        return got[0]

    def ask(self, op: str, **kwargs: Any) -> Any:
        """Send one request and wait for its answer; an exited process fails in one line naming it."""
        try:
            self.conn.send((op, kwargs))
            while not self.conn.poll(1.0):
                if self.proc.poll() is not None:
                    raise self._died(f"exited during {op}")
            status, answer = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            raise self._died(f"lost during {op}") from None
        if status != "ok":
            raise EngineDied(f"{self.what} failed {op}: {answer}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("close")
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
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


def _key(name: str) -> str:
    return f"vllm/{name}"


def engine(ctx: DeviceContext, name: str) -> EngineProcess:
    held = ctx.resident.get(_key(name))
    if not isinstance(held, EngineProcess):
        raise RuntimeError(f"no vLLM engine of {name} on device {ctx.rank}; start it first")
    return held


def start_engine(
    ctx: DeviceContext, *, name: str, replica: int, cores: str, settings: dict[str, Any]
) -> float:
    """Start replica ``replica``'s engine of ``name`` on this device (its first slot); returns seconds."""
    start = time.perf_counter()
    stop_engine(ctx, name=name)
    work = Path(settings["work_dir"]) / f"replica{replica}"
    what = f"vLLM engine of {name} replica {replica} (device {ctx.rank})"
    proc = EngineProcess(what, cores, work / "engine.log")
    ctx.resident[_key(name)] = proc
    proc.ask("start", **{**settings, "work_dir": str(work)})
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
    ctx: DeviceContext, *, name: str, files: list[str], layout_json: str, config_json: str
) -> dict[str, float]:
    """The engine of ``name`` on this device reloads its weights in place from ``files``."""
    return engine(ctx, name).ask("reload", files=files, layout_json=layout_json, config_json=config_json)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's responses ``[b, T]`` and the engine's log-probs of them ``[b, T]``."""
    rows = sampling.prompt_lists(prompts_bs, prompt_mask_bs)
    # vLLM samples n > 1 only with a temperature; greedy copies are asked one by one (the prefix
    # cache shares their prompt)
    firsts = sampling.distinct_prompts(rows, group) if request.temperature > 0 else None
    asked, n = (firsts, group) if firsts is not None else (rows, 1)
    per = dict(request.__dict__, n=n)
    params = [sampling.SamplingRequest(**per).params(row_offset + i * n) for i in range(len(asked))]
    answers = engine(ctx, name).ask("generate", prompts=asked, params=params)
    samples = [sample for prompt in answers for sample in prompt]
    return sampling.response_tensors(samples, request.max_new_tokens, pad_id)
