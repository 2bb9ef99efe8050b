"""A PPO job (actor, critic, reference; the count task's rule) with ``rollout.engine: vllm``: it
completes, every step's engine log-probs equal the train layout's old ones on the weights the engine
was synced to while the actor's training moves those weights every step."""

from __future__ import annotations

import copy

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
    pytest.mark.slow,  # an engine process start and a Prefect flow of three PPO steps: about two minutes
]

STEPS = 3
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
PPO_VLLM["job"] = {**PPO_VLLM["job"], "steps": STEPS, "batch_size": 8}


def test_a_ppo_job_on_vllm_completes_and_its_engine_follows_the_trained_actor(tmp_path) -> None:
    out = tmp_path / "run"
    rl_job(config=parse_config(PPO_VLLM), out_dir=str(out))
    run = RunDir(out)
    assert run.read_summary()["status"] == "completed"
    history = run.read_rows("metrics/history.parquet")
    assert [h["step"] for h in history] == list(range(STEPS))
    for h in history:
        # the actor moved every step (lr 1e-2), and the engine synced to it still agrees with it
        assert h["actor_grad_norm"] > 0 and h["critic_grad_norm"] > 0, h
        assert h["rollout_logp_diff_max"] < TOLERANCE, h
    last = run.read_rollout(STEPS - 1)
    assert torch.tensor(last["values"]).abs().sum() > 0  # the critic ran on the engine's responses
