"""Jobs run as a user runs them, through ``nereus`` in a process of its own (started, killed, resumed),
and the checks the fault and switch tests make on the run directories they leave."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq
import torch
from transformers import LlamaForCausalLM

from flows.cli.main import FAULT_ENV
from storage import read_full_state
from storage.export import export_hf
from storage.journal import Journal, journals
from storage.run_dir import RunDir
from tests.support.processes import kill_session

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "flows.cli.main"]
PPO_MODELS = ("actor", "critic", "reference", "reward")


def cli_env(tmp_path: Path, fault: str | None = None) -> dict[str, str]:
    """This environment with a cache of the test's own and ``fault`` armed (none if not given)."""
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env["NEREUS_CACHE_DIR"] = str(tmp_path / "cache")
    return env if fault is None else {**env, FAULT_ENV: fault}


def start_run(tmp_path: Path, data: dict, fault: str | None = None) -> tuple[subprocess.Popen, Path]:
    """``nereus run`` of ``data`` in its own session (so that its workers can be killed with it)."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(data))  # JSON is YAML
    out = tmp_path / "run"
    driver = subprocess.Popen(
        [*CLI, "run", str(config), "--out", str(out)],
        cwd=ROOT,
        env=cli_env(tmp_path, fault),
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "driver.log").open("w"),  # a pipe would stay open in its orphans
        start_new_session=True,
    )
    return driver, out


def kill_after_checkpoint(
    driver: subprocess.Popen, out: Path, step: int, tmp_path: Path, limit_s: float = 240.0
) -> None:
    """Kill the driver's session as soon as its checkpoint of ``step`` is complete; fails with the end
    of its log if the driver ends first or the checkpoint takes longer than ``limit_s`` seconds."""
    ready = out / "state" / "checkpoints" / f"step={step}.json"
    deadline = time.monotonic() + limit_s
    try:
        while not ready.exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), (tmp_path / "driver.log").read_text()[-2000:]
    finally:
        kill_session(driver)


def resume(tmp_path: Path, out: Path, *extra: str) -> None:
    """``nereus resume`` of the run directory ``out``, which must succeed."""
    done = subprocess.run(
        [*CLI, "resume", str(out), *extra],
        cwd=ROOT,
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def killed_mid_move(tmp_path: Path, data: dict, timeout_s: float) -> tuple[Path, Journal]:
    """``nereus run`` of ``data`` whose driver is killed (fault ``kill-driver:move``) while its first
    transition moves state. Returns the run directory and that transition's journal, interrupted."""
    crashed, out = start_run(tmp_path, data, fault="kill-driver:move")
    try:
        crashed.wait(timeout=timeout_s)
    finally:
        kill_session(crashed)
    assert crashed.returncode == -signal.SIGKILL, (tmp_path / "driver.log").read_text()[-2000:]
    (journal,) = [j for j in journals(out) if j.transition_id.startswith("t000")]
    assert journal.status() == "interrupted"
    return out, journal


def resume_from_checkpoint(
    tmp_path: Path, out: Path, step: int, *extra: str, models: Sequence[str] = PPO_MODELS
) -> dict:
    """``nereus resume`` of ``out`` (with ``extra`` arguments), which must complete from the checkpoint
    of ``step``: the state rehydrated from it verified bitwise, and the checkpoint left untouched.
    Returns the run's summary."""
    before = digests(out, step, models)
    resume(tmp_path, out, *extra)
    summary = RunDir(out).read_summary()
    assert summary["status"] == "completed" and summary["resumed_from_step"] == step
    assert summary["resume_verified_bitwise"] and digests(out, step, models) == before
    return summary


def gsm8k_files(root: Path) -> dict[str, Path]:
    """The GSM8K train and test splits as ``nereus data gsm8k`` writes them under ``root``."""
    done = subprocess.run(
        [*CLI, "data", "gsm8k", "--out", str(root / "gsm8k")], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return {"train": root / "gsm8k" / "train.parquet", "test": root / "gsm8k" / "test.parquet"}


def assert_rollout_made_by_checkpoint(run_dir: Path, step: int, tmp_path: Path) -> None:
    """Rollout ``step``'s stored old log-probs == transformers on the actor checkpointed at ``step``."""
    export_hf(run_dir, model="actor", step=step, out=tmp_path / f"hf{step}")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / f"hf{step}", torch_dtype=torch.float32).eval()
    rollout = RunDir(run_dir).read_rollout(step)
    ids = torch.cat([torch.tensor(rollout["prompts"]), torch.tensor(rollout["responses"])], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    t = len(rollout["responses"][0])
    assert (logp[:, -t:] - torch.tensor(rollout["old_logp"])).abs().max().item() <= 1e-4


def digests(run_dir: Path, step: int, models: Sequence[str] = PPO_MODELS) -> dict[str, dict[str, bytes]]:
    """The bytes of every tensor (optimizer state included) of each model's checkpoint at ``step``."""
    return {
        model: {
            k: v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # any dtype, bf16 too
            for k, v in read_full_state(run_dir, model, step, optimizer=True).items()
        }
        for model in models
    }


def plans_by_step(run_dir: Path) -> dict[int, str]:
    """The plan id each step ran on, from the steps table."""
    rows = pq.read_table(run_dir / "metrics" / "steps.parquet").to_pylist()
    return {r["step"]: r["plan_id"] for r in rows}
