"""A PPO job (actor, critic, reference; the count task's rule) with ``rollout.engine: vllm``, one of its
engine processes killed (SIGKILL) once the step-1 checkpoint is written:

- the job fails in one line naming the engine and its pid;
- ``rl_job`` on the same run directory (what ``nereus resume`` runs) starts new engines from the newest
  checkpoint and completes, every step recorded once, nothing lost, and the rule score rises;
- every step's engine log-probs equal the train layout's old ones on the weights the engine was synced
  to, while the actor's training moves those weights every step, and the critic ran on the engine's
  responses.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from flows.job.rl_job import rl_job
from nereus_core.config import parse_config, vllm_installed
from storage.run_dir import RunDir
from tests.flows.job.test_grpo_vllm_job import GRPO_VLLM, TOLERANCE

pytestmark = [
    pytest.mark.usefixtures("prefect_server"),  # the flows run against the suite's one Prefect server
    pytest.mark.skipif(
        not vllm_installed(), reason="vLLM is not installed (pip install -e '.[vllm]' or make install-vllm)"
    ),
    pytest.mark.timeout(900),  # two engine starts (the kill, the resume) and four PPO steps
]

STEPS = 4
PPO_VLLM = copy.deepcopy(GRPO_VLLM) | {
    "name": "ppo-vllm-test",
    "algorithm": {"name": "ppo"},
    "ppo": {"kl_coef": 0.01, "ppo_epochs": 1, "mini_batches": 2, "actor_lr": 1e-2},
    "plan": {
        "actor/generate": {"devices": [0]},
        "actor/train": {"dp": 2, "devices": [0, 1]},
        "critic/train": {"devices": [1]},
    },
}
PPO_VLLM["job"] = {**PPO_VLLM["job"], "steps": STEPS, "batch_size": 8, "snapshot_every": 1}


def _kill_engine_when(path: Path, done: threading.Event, killed: list[int]) -> None:
    """Kill (SIGKILL) the first vLLM engine process once ``path`` exists (a checkpoint was written)."""
    while not done.is_set():
        if path.exists():
            for proc in psutil.process_iter(["pid", "cmdline"]):
                if "tasks.runtime.vllm_host" in " ".join(proc.info["cmdline"] or []):
                    os.kill(proc.info["pid"], signal.SIGKILL)
                    killed.append(proc.info["pid"])
                    return
        time.sleep(0.05)


def test_a_killed_engine_fails_the_ppo_job_in_one_line_and_resume_completes_it(tmp_path) -> None:
    out = tmp_path / "run"
    done, killed = threading.Event(), []
    watcher = threading.Thread(
        target=_kill_engine_when, args=(RunDir(out).checkpoint_path(1), done, killed), daemon=True
    )
    watcher.start()
    try:
        with pytest.raises(Exception) as failed:
            rl_job(config=parse_config(PPO_VLLM), out_dir=str(out))
    finally:
        done.set()
    assert killed, "no engine process was found to kill"
    first = str(failed.value).strip().splitlines()[0]
    assert "vLLM engine of actor/generate" in first and str(killed[0]) in first, first

    summary = rl_job(config=parse_config(PPO_VLLM), out_dir=str(out))
    assert summary["status"] == "completed" and summary["resumed_from_step"] >= 1
    run = RunDir(out)
    history = run.read_rows("metrics/history.parquet")
    assert [h["step"] for h in history] == list(range(STEPS))  # every step recorded once, in order
    for h in history:
        # the actor moved every step (lr 1e-2), and the engine synced to it still agrees with it
        assert h["actor_grad_norm"] > 0 and h["critic_grad_norm"] > 0, h
        assert h["rollout_logp_diff_max"] < TOLERANCE, h
    scores = [h["rule_score"] for h in history]
    assert sum(scores[-2:]) / 2 > sum(scores[:2]) / 2 + 0.05, scores  # it learns (0.05 -> 0.32 measured)
    last = run.read_rollout(STEPS - 1)
    assert torch.tensor(last["values"]).abs().sum() > 0  # the critic ran on the engine's responses
