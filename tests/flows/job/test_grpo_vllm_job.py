"""A GRPO job with ``rollout.engine: vllm`` through the job flow: vLLM's engine generates every step,
takes actor/train's weights in place after every step, and its log-prob of every sampled token equals
the old log-prob the train layout recomputes on the same weights (Nereus's own decoder)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from flows.job.rl_job import rl_job
from nereus_core.config import parse_config, vllm_installed
from storage.run_dir import RunDir

pytestmark = [
    pytest.mark.usefixtures("prefect_server"),  # the flows run against the suite's one Prefect server
    pytest.mark.skipif(
        not vllm_installed(), reason="vLLM is not installed (pip install -e '.[vllm]' or make install-vllm)"
    ),
    pytest.mark.slow,  # an engine process start (vLLM's import) and a Prefect flow: about two minutes
]

GROUP, STEPS, T = 4, 3, 6
# head_dim 64: the CPU attention kernel of vLLM needs at least 32
MODEL = {
    "vocab_size": 32,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
GRPO_VLLM = {
    "name": "grpo-vllm-test",
    "cluster": {"devices": 2, "memory_per_device": "512MiB"},
    "model": MODEL,
    "job": {"steps": STEPS, "batch_size": 16, "prompt_len": 4, "response_len": T},
    "algorithm": {"name": "grpo", "group_size": GROUP},
    "ppo": {"kl_coef": 0.0, "use_kl_loss": False, "ppo_epochs": 1, "mini_batches": 2, "actor_lr": 1e-2},
    "rollout": {"engine": "vllm", "kv_cache_memory_bytes": "32MiB", "max_num_seqs": 64},
    "plan": {"actor/generate": {"devices": [0]}, "actor/train": {"dp": 2, "devices": [0, 1]}},
}
# fp32 on both sides: vLLM's CPU kernels and Nereus's decoder differ by rounding only
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-vllm-run")
    rl_job(config=parse_config(GRPO_VLLM), out_dir=str(out))
    return out


def test_the_job_completes_on_vllm(run_dir):
    summary = RunDir(run_dir).read_summary()
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    rows = pq.read_table(run_dir / "metrics" / "steps.parquet").to_pylist()
    syncs = [r for r in rows if (r["model"], r["stage"]) == ("actor", "sync") and r["duration_s"] > 0]
    assert len(syncs) >= STEPS  # the engine took the new weights after every step


def test_vllm_logprobs_equal_the_train_layouts_after_every_sync(run_dir):
    history = RunDir(run_dir).read_rows("metrics/history.parquet")
    assert [h["step"] for h in history] == list(range(STEPS))
    for h in history:
        assert h["rollout_logp_diff_max"] < TOLERANCE, h
    for step in range(STEPS):
        r = RunDir(run_dir).read_rollout(step)
        engine, old = torch.tensor(r["rollout_logp"]), torch.tensor(r["old_logp"])
        assert engine.shape == old.shape == (16, T)
        assert (engine - old).abs().max() < TOLERANCE
        responses = torch.tensor(r["responses"]).view(-1, GROUP, T)
        assert any(len({tuple(x.tolist()) for x in g}) > 1 for g in responses)  # n samples differ
