"""A GRPO job with ``rollout.engine: vllm`` through the job flow, its generation switched live from tp1
dp2 to tp2 dp1 after step 0 (forced: tests/support/forced_switches.py; once: a switch back, with its
engine set started, cost the default suite about 40 s on two cores):

- it completes and learns: the rule score rises over the run;
- vLLM's engines generate every step and take actor/train's weights in place after every step, and
  their log-prob of every sampled token equals the old log-prob the train layout recomputes on the same
  weights (Nereus's own decoder), on the engines of every layout, and transformers' on the actor
  exported after every step (a checkpoint each step);
- the switch rebuilds the engines: the old engines' greedy answer to a probe batch equals the new
  ones' (tokens and log-probs), every model's state is verified bitwise against the checkpoint before
  the switch, and the rebuild's seconds are part of the switch's measured seconds (the engine term's
  pricing: tests/core/controller/test_transition_schedule.py).
"""

from __future__ import annotations

import copy

import pyarrow.parquet as pq
import pytest
import torch

from flows.job import switch as switch_module
from flows.job.rl_job import rl_job
from nereus_core.config import parse_config, vllm_installed
from nereus_core.layout import Layout
from storage.export import export_hf
from storage.run_dir import RunDir
from tests.support.forced_switches import forced_controller
from tests.support.model_configs import VLLM_JOB_MODEL

pytestmark = [
    pytest.mark.usefixtures("prefect_server"),  # the flows run against the suite's one Prefect server
    pytest.mark.skipif(
        not vllm_installed(), reason="vLLM is not installed (pip install -e '.[vllm]' or make install-vllm)"
    ),
    pytest.mark.timeout(900),  # two engine sets started (one of tp 2): about two minutes
]

GROUP, STEPS, T = 4, 5, 6
MODEL = VLLM_JOB_MODEL
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
DP2 = Layout(tp=1, dp=2, devices=(0, 1))
TP2 = Layout(tp=2, dp=1, devices=(0, 1))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    data = copy.deepcopy(GRPO_VLLM)
    data["plan"]["actor/generate"] = DP2.model_dump(mode="json")
    data["job"] |= {"adapt": True, "verify_transitions": True, "snapshot_every": 1, "keep_checkpoints": 0}
    out = tmp_path_factory.mktemp("grpo-vllm-run")
    with pytest.MonkeyPatch.context() as patch:
        targets = {0: {"actor/generate": TP2}}
        patch.setattr(switch_module, "controller_step", forced_controller(targets))
        rl_job(config=parse_config(data), out_dir=str(out))
    return out


def test_the_job_completes_on_vllm_and_learns(run_dir):
    summary = RunDir(run_dir).read_summary()
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    rows = pq.read_table(run_dir / "metrics" / "steps.parquet").to_pylist()
    syncs = [r for r in rows if (r["model"], r["stage"]) == ("actor", "sync") and r["duration_s"] > 0]
    assert len(syncs) >= STEPS  # the engine took the new weights after every step
    scores = [h["rule_score"] for h in RunDir(run_dir).read_rows("metrics/history.parquet")]
    # a uniform policy over 32 tokens scores about 0.1; lr 1e-2 moves it within a few steps
    assert sum(scores[-2:]) / 2 > sum(scores[:2]) / 2 + 0.05, scores


def test_vllm_logprobs_equal_the_train_layouts_after_every_sync(run_dir):
    history = RunDir(run_dir).read_rows("metrics/history.parquet")
    assert [h["step"] for h in history] == list(range(STEPS))
    for h in history:  # step 0 on two tp-1 engines, the others on one tp-2 engine
        assert h["rollout_logp_diff_max"] < TOLERANCE, h
    for step in range(STEPS):
        r = RunDir(run_dir).read_rollout(step)
        engine, old = torch.tensor(r["rollout_logp"]), torch.tensor(r["old_logp"])
        assert engine.shape == old.shape == (16, T)
        assert (engine - old).abs().max() < TOLERANCE
        responses = torch.tensor(r["responses"]).view(-1, GROUP, T)
        assert any(len({tuple(x.tolist()) for x in g}) > 1 for g in responses)  # n samples differ


def test_vllm_logprobs_equal_transformers_on_the_actor_exported_after_every_sync(run_dir, tmp_path):
    """A checkpoint after every step: the actor exported at step N is the one every engine was synced
    to before generating step N, on the tp-2 engine the switch started (step 1) and synced after
    (steps 2-4)."""
    from transformers import AutoModelForCausalLM

    steps = [s for s in RunDir(run_dir).checkpoint_steps() if s < STEPS]
    assert steps == list(range(1, STEPS)), steps
    for step in steps:
        out = export_hf(run_dir, model="actor", step=step, out=tmp_path / f"actor-{step}")
        hf = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        r = RunDir(run_dir).read_rollout(step)
        ids = torch.cat([torch.tensor(r["prompts"]), torch.tensor(r["responses"])], 1)
        with torch.no_grad():
            logits = hf(ids).logits
        logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0][:, -T:]
        gap = ((logp - torch.tensor(r["rollout_logp"])) * torch.tensor(r["mask"]).float()).abs()
        assert gap.max() < TOLERANCE, (step, gap.max())  # measured: 6e-7


def test_a_switch_of_generations_tp_rebuilds_the_engines_verified(run_dir):
    rows = pq.read_table(run_dir / "metrics" / "transitions.parquet").to_pylist()
    assert [(r["step"], r["status"], r["route"]) for r in rows] == [(0, "committed", "live")]
    for r in rows:
        assert r["verified_bitwise"] is True, r
        assert r["engine_verified"] is True and r["engine_probe_logp_diff_max"] <= TOLERANCE, r
        assert 0 < r["engine_start_s"] < r["engine_rebuild_s"] <= r["actual_s"], r  # measured, in the switch
