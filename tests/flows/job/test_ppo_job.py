"""The PPO job flow end to end on a small config, under Prefect's test harness."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from storage import read_full_state
from storage.run_dir import RunDir
from tests.support.job_runs import assert_rollout_made_by_checkpoint

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

SMALL = {
    "name": "ppo-test",
    "cluster": {"devices": 4},
    "model": {
        "vocab_size": 32,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "job": {"steps": 2, "batch_size": 8, "prompt_len": 4, "response_len": 4, "snapshot_every": 1},
    "ppo": {"reward_fit_steps": 3, "reward_fit_batch": 8, "ppo_epochs": 1, "mini_batches": 2},
    "plan": {
        "actor/generate": {"tp": 2, "devices": [2, 3]},
        "actor/train": {"tp": 2, "pp": 2, "devices": [0, 1, 2, 3], "micro_batches": 2},
        "critic/train": {"dp": 2, "devices": [0, 1]},
        "critic/infer": {"dp": 2, "devices": [0, 1]},
        "reference/infer": {"pp": 2, "devices": [3, 2]},
        "reward/infer": {"devices": [1]},
    },
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("run")
    monkeypatch_module.setenv("NEREUS_CACHE_DIR", str(out / "cache"))
    rl_job(config=parse_config(SMALL), out_dir=str(out))
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_run_directory_has_every_documented_file(run_dir):
    summary = RunDir(run_dir).read_summary()
    assert summary["status"] == "completed" and summary["steps"] == 2
    for key in (
        "wall_s",
        "reward_first",
        "reward_last",
        "transitions",
        "transition_s_total",
        "final_plan_id",
    ):
        assert key in summary
    assert (run_dir / "config.yaml").exists()
    assert (run_dir / "plans" / f"{summary['final_plan_id']}.json").exists()
    for step in (0, 1):
        assert (run_dir / "rollouts" / f"step={step}.parquet").exists()
    steps = pq.read_table(run_dir / "metrics" / "steps.parquet").to_pylist()
    stages = {(r["model"], r["stage"]) for r in steps}
    for expected in [("actor", "generate"), ("actor", "train"), ("critic", "train"), ("reward", "infer")]:
        assert expected in stages


def test_stage_times_add_up_to_at_most_the_step_wall_time(run_dir):
    steps = pq.read_table(run_dir / "metrics" / "steps.parquet").to_pylist()
    for step in (0, 1):
        rows = [r for r in steps if r["step"] == step]
        inside = sum(r["duration_s"] for r in rows)
        wall = rows[0]["step_wall_s"]
        assert 0 < inside <= wall
        assert all(r["duration_s"] >= 0 for r in rows)


def test_stored_old_logprobs_match_transformers_on_the_exported_actor(run_dir, tmp_path):
    """The actor trained on tp=2, pp=2; its snapshot of step 1 generated rollout 1."""
    assert_rollout_made_by_checkpoint(run_dir, 1, tmp_path)


def test_snapshots_differ_between_steps_and_reference_stays_put(run_dir):
    actor1 = read_full_state(run_dir, "actor", step=1)
    actor2 = read_full_state(run_dir, "actor", step=2)
    assert any(not torch.equal(actor1[k], actor2[k]) for k in actor1)
    ref1 = read_full_state(run_dir, "reference", step=1)
    ref2 = read_full_state(run_dir, "reference", step=2)
    assert all(torch.equal(ref1[k], ref2[k]) for k in ref1)


def test_history_logs_the_ppo_statistics_and_response_lengths_of_every_step(run_dir):
    history = RunDir(run_dir).read_rows("metrics/history.parquet")
    assert [h["step"] for h in history] == [0, 1]
    for h in history:
        for key in ("actor_loss", "actor_clip_frac", "actor_approx_kl", "actor_entropy", "actor_grad_norm"):
            assert key in h and h[key] == h[key], key  # present and not NaN
        assert 0.0 <= h["actor_clip_frac"] <= 1.0 and h["actor_entropy"] > 0 and h["actor_grad_norm"] > 0
        assert 0.0 <= h["critic_value_clip_frac"] <= 1.0 and h["critic_grad_norm"] > 0
        # the count task's responses are fixed-length: every one reaches the limit
        assert h["response_len_mean"] == h["response_len_max"] == 4 and h["response_clip_frac"] == 1.0


@pytest.mark.slow  # another run of the job: about 40 s
def test_gradient_checkpointing_trains_the_same_models_bitwise(run_dir, tmp_path, monkeypatch):
    """model.gradient_checkpointing (every decoder layer recomputed in the backward pass, tp2 pp2 actor,
    dp2 critic) ends the run with the actor and the critic equal bit for bit to the run without it."""
    import copy

    config = copy.deepcopy(SMALL)
    config["model"]["gradient_checkpointing"] = True
    out = tmp_path / "checkpointed"
    monkeypatch.setenv("NEREUS_CACHE_DIR", str(out / "cache"))
    rl_job(config=parse_config(config), out_dir=str(out))
    for model in ("actor", "critic"):
        plain, again = (read_full_state(d, model, step=2) for d in (run_dir, out))
        assert plain.keys() == again.keys() and all(torch.equal(plain[k], again[k]) for k in plain), model
    history = [RunDir(d).read_rows("metrics/history.parquet") for d in (run_dir, out)]
    assert [h["actor_loss"] for h in history[0]] == [h["actor_loss"] for h in history[1]]
    models = parse_config(config).models  # the flag reaches both trained models
    assert models["actor"].gradient_checkpointing and models["critic"].gradient_checkpointing
