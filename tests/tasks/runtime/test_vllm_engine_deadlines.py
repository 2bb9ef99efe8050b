"""Every request to a vLLM engine process (tasks/runtime/vllm_engine.py) ends within its deadline, even
when the process is stopped (SIGSTOP: alive, silent): it fails in one line naming the engine, its
model-stage, its pid and the deadline, and the process is killed. An engine whose weight load failed
or timed out is never asked to generate again. These run the real engine process without vLLM: it
connects and answers before it imports vLLM, and a stopped process is the same with or without it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nereus_core.engine.sampling import SamplingRequest
from tasks.runtime import vllm_engine

pytestmark = pytest.mark.timeout(120)  # the code before deadlines waited for ever on a stopped engine

NAME = "actor/generate"
DEADLINE_S = 2.0
# A deadline is polled every POLL_S and the kill is reaped at once; a loaded machine adds seconds.
LATE_S = 10.0


def _release(proc: subprocess.Popen) -> None:
    """Whatever a test left: resumed and killed, then reaped."""
    if proc.poll() is None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            os.kill(proc.pid, sig)
        proc.wait()


@pytest.fixture
def stopped(tmp_path: Path) -> Iterator[tuple[Any, vllm_engine.EngineProcess]]:
    """A device context holding a connected engine process of actor/generate, stopped (SIGSTOP)."""
    ctx = types.SimpleNamespace(rank=0, resident={})
    what = f"vLLM engine of {NAME} replica 0 (device 0)"
    proc = vllm_engine.EngineProcess(what, "nobind", tmp_path / "engine.log", deadline_s=60)
    ctx.resident["vllm/" + NAME] = proc
    try:
        os.kill(proc.proc.pid, signal.SIGSTOP)
        yield ctx, proc
    finally:
        _release(proc.proc)


def _generate(ctx: Any, rows: int = 2, width: int = 4, deadline_s: float = DEADLINE_S) -> Any:
    return vllm_engine.engine_generate(
        ctx,
        torch.ones(rows, width, dtype=torch.long),
        None,
        name=NAME,
        request=SamplingRequest(max_new_tokens=4),
        group=1,
        row_offset=0,
        pad_id=0,
        deadline_s=deadline_s,
    )


def _reload(ctx: Any, deadline_s: float = DEADLINE_S) -> Any:
    return vllm_engine.reload_engine(
        ctx, name=NAME, files=["/nonexistent"], layout_json="{}", config_json="{}", deadline_s=deadline_s
    )


def _assert_timed_out(err: BaseException, proc: vllm_engine.EngineProcess, op: str, took: float) -> None:
    line = str(err)
    assert "\n" not in line, line  # one line
    assert f"vLLM engine of {NAME} replica 0 (device 0) (pid {proc.proc.pid})" in line, line
    assert f"{op} within its deadline of {DEADLINE_S:.1f} s" in line, line
    assert DEADLINE_S <= took < DEADLINE_S + LATE_S, took
    assert proc.proc.poll() == -signal.SIGKILL  # killed, and reaped


@pytest.mark.parametrize("rows", [2, 32768], ids=["small", "over-the-socket-buffer"])
def test_a_stopped_engine_fails_a_generate_within_its_deadline_naming_its_pid(
    stopped: tuple[Any, vllm_engine.EngineProcess], rows: int
) -> None:
    """32,768 rows of 128 tokens pickle to tens of MB: the send itself blocks on the stopped reader."""
    ctx, proc = stopped
    width = 4 if rows == 2 else 128
    start = time.monotonic()
    with pytest.raises(vllm_engine.EngineTimeout) as failed:
        _generate(ctx, rows=rows, width=width)
    _assert_timed_out(failed.value, proc, "generate", time.monotonic() - start)
    assert "rollout.generate_timeout_s" in str(failed.value)
    with pytest.raises(vllm_engine.EngineDied, match=rf"pid {proc.proc.pid}.*start the engines again"):
        _generate(ctx)  # the killed engine is never asked again


def test_a_weight_load_that_misses_its_deadline_leaves_no_engine_to_generate_on(
    stopped: tuple[Any, vllm_engine.EngineProcess],
) -> None:
    ctx, proc = stopped
    start = time.monotonic()
    with pytest.raises(vllm_engine.EngineTimeout) as failed:
        _reload(ctx)
    _assert_timed_out(failed.value, proc, "reload", time.monotonic() - start)
    assert "rollout.sync_timeout_s" in str(failed.value)
    start = time.monotonic()
    with pytest.raises(vllm_engine.EngineDied, match=r"reload.*start the engines again"):
        _generate(ctx, deadline_s=60)
    assert time.monotonic() - start < 1.0  # refused at once, never sent


def test_a_weight_load_that_fails_midway_stops_the_engine_before_any_generate(tmp_path: Path) -> None:
    """A reload that raises inside the engine may have replaced some layers: the engine is killed."""
    ctx = types.SimpleNamespace(rank=0, resident={})
    proc = vllm_engine.EngineProcess(
        "vLLM engine of actor/generate replica 0 (device 0)", "nobind", tmp_path / "engine.log", deadline_s=60
    )
    ctx.resident["vllm/" + NAME] = proc
    try:
        with pytest.raises(vllm_engine.EngineDied, match=rf"\(pid {proc.proc.pid}\) failed reload"):
            _reload(ctx, deadline_s=60)  # no engine was built in it: the reload raises there
        assert proc.proc.poll() is not None  # stopped, though it still answered
        with pytest.raises(vllm_engine.EngineDied, match=r"failed reload.*start the engines again"):
            _generate(ctx, deadline_s=60)
    finally:
        _release(proc.proc)


def test_a_stopped_engine_is_closed_within_a_fixed_time(
    stopped: tuple[Any, vllm_engine.EngineProcess],
) -> None:
    """Stopping the job's engines (its last act when a step failed) waits on none of them for ever."""
    ctx, proc = stopped
    start = time.monotonic()
    vllm_engine.stop_engine(ctx, name=NAME)
    took = time.monotonic() - start
    assert vllm_engine.CLOSE_TIMEOUT_S <= took < vllm_engine.CLOSE_TIMEOUT_S + LATE_S, took
    assert proc.proc.poll() == -signal.SIGKILL


def test_an_engine_stopped_before_it_connects_fails_its_start_within_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen] = []
    spawn = subprocess.Popen

    def stopped_at_once(*args: Any, **kwargs: Any) -> subprocess.Popen:
        proc = spawn(*args, **kwargs)
        os.kill(proc.pid, signal.SIGSTOP)
        started.append(proc)
        return proc

    monkeypatch.setattr(vllm_engine.subprocess, "Popen", stopped_at_once)
    ctx = types.SimpleNamespace(rank=0, resident={})
    settings = {"work_dir": str(tmp_path)}
    start = time.monotonic()
    try:
        with pytest.raises(vllm_engine.EngineTimeout) as failed:
            vllm_engine.start_engine(
                ctx, name=NAME, replica=0, cores="nobind", settings=settings, deadline_s=DEADLINE_S
            )
        took = time.monotonic() - start
    finally:
        monkeypatch.undo()
        for proc in started:
            _release(proc)
    line = str(failed.value)
    assert f"(pid {started[0].pid}) gave no answer to start within its deadline of 2.0 s" in line, line
    assert "rollout.start_timeout_s" in line and "\n" not in line, line
    assert DEADLINE_S <= took < DEADLINE_S + LATE_S, took
    assert started[0].returncode == -signal.SIGKILL and ctx.resident == {}
