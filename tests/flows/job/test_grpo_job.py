"""A GRPO job through the job flow end to end on a small config, under Prefect's test harness: its
plan and state hold no critic and no reward model, its rollouts come in groups, its metrics are written."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from storage import read_full_state
from storage.run_dir import RunDir
from tests.support.job_configs import SMALL_MODEL

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

GROUP = 4
SMALL_GRPO = {
    "name": "grpo-test",
    "cluster": {"devices": 2},
    "model": dict(SMALL_MODEL),
    "job": {"steps": 3, "batch_size": 16, "prompt_len": 4, "response_len": 4, "snapshot_every": 1},
    "algorithm": {"name": "grpo", "group_size": GROUP},
    # a KL loss and no KL penalty: the reference runs, for the loss term only
    "ppo": {"kl_coef": 0.0, "use_kl_loss": True, "kl_loss_coef": 0.01, "ppo_epochs": 2, "mini_batches": 2},
    "plan": {
        "actor/generate": {"devices": [1]},
        "actor/train": {"pp": 2, "devices": [0, 1]},
        "reference/infer": {"devices": [0]},
    },
}
STAGES = {"actor/generate", "actor/train", "reference/infer"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-run")
    rl_job(config=parse_config(SMALL_GRPO), out_dir=str(out))
    return out


def test_the_plan_and_the_state_have_no_critic_and_no_reward_model(run_dir):
    summary = RunDir(run_dir).read_summary()
    assert summary["status"] == "completed" and summary["steps"] == 3
    plan = json.loads((run_dir / "plans" / f"{summary['final_plan_id']}.json").read_text())
    assert set(plan) == STAGES
    assert {p.name for p in (run_dir / "state").iterdir()} == {"actor", "reference", "checkpoints"}
    steps = pq.read_table(run_dir / "metrics" / "steps.parquet").to_pylist()
    models = {r["model"] for r in steps}
    assert "critic" not in models and "reward" not in models
    assert {("actor", "generate"), ("actor", "infer"), ("reference", "infer"), ("actor", "train")} <= {
        (r["model"], r["stage"]) for r in steps
    }
    assert summary["reward_fit"] == {"first_mse": None, "last_mse": None}  # no reward model was fitted


def test_rollouts_come_in_groups_with_group_relative_advantages(run_dir):
    for step in range(3):
        r = RunDir(run_dir).read_rollout(step)
        prompts = torch.tensor(r["prompts"]).view(-1, GROUP, 4)
        assert (prompts == prompts[:, :1]).all()  # a prompt's copies side by side
        responses = torch.tensor(r["responses"]).view(-1, GROUP, 4)
        assert any(len({tuple(x.tolist()) for x in g}) > 1 for g in responses)  # copies sample apart
        assert "values" not in r and "returns" not in r  # no critic
        adv_b = torch.tensor(r["advantages"])[:, 0].view(-1, GROUP)
        assert torch.allclose(adv_b.sum(dim=1), torch.zeros(adv_b.shape[0]), atol=1e-4)
        assert torch.allclose(torch.tensor(r["rewards"]).sum(dim=1), torch.tensor(r["rule_score"]), atol=1e-6)


def test_history_has_the_actor_statistics_and_the_kl_loss(run_dir):
    history = RunDir(run_dir).read_rows("metrics/history.parquet")
    assert [h["step"] for h in history] == [0, 1, 2]
    for h in history:
        assert h["score"] == h["rule_score"]  # GRPO trains on the rule's score
        for key in ("actor_loss", "actor_clip_frac", "actor_approx_kl", "actor_entropy", "actor_grad_norm"):
            assert h[key] == h[key], key  # present and not NaN
        assert h["actor_kl_loss"] >= 0 and h["actor_grad_norm"] > 0
        assert "critic_loss" not in h or h["critic_loss"] is None


def test_the_actor_moves_and_the_reference_stays_put(run_dir):
    actor1, actor3 = read_full_state(run_dir, "actor", step=1), read_full_state(run_dir, "actor", step=3)
    assert any(not torch.equal(actor1[k], actor3[k]) for k in actor1)
    ref1, ref3 = read_full_state(run_dir, "reference", step=1), read_full_state(run_dir, "reference", step=3)
    assert all(torch.equal(ref1[k], ref3[k]) for k in ref1)


@pytest.mark.slow  # the demo as shipped: 40 steps, about 1 to 2 minutes on two loaded cores
@pytest.mark.timeout(900)
def test_the_grpo_demo_learns_the_count_task(tmp_path):
    from nereus_core.config.from_yaml import parse_yaml

    config = parse_yaml((Path(__file__).resolve().parents[3] / "examples" / "tiny_grpo.yaml").read_text())
    summary = rl_job(config=parse_config(config), out_dir=str(tmp_path / "run"))
    # mean rule score of the last five steps against the first five (a random policy scores ~0.1)
    assert summary["score_last"] > summary["score_first"] + 0.3, summary
    assert summary["transitions"] >= 1  # two slots join before step 15: at least that switch
