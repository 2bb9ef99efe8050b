"""A step's responses are cut to the batch's longest before any pass (rollout.cut_to_longest in
flows/job/rl_step.run_step): the same GRPO step without the cut (patched off) is the evidence that
the passes, the losses (Dr. GRPO's constant included: the generation's limit, not the cut width), the
update and the length statistics are unchanged, and the rollout written is the cut one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nereus_core.rl import rollout
from tests.support.job_configs import SMALL_MODEL
from tests.support.one_step import MANY_STOPS, run_one_step

LIMIT = 16
CONFIG = {
    "name": "grpo-cut",
    "cluster": {"devices": 1},
    "model": dict(SMALL_MODEL),
    "algorithm": {"name": "grpo", "group_size": 4, "loss_agg_mode": "seq-mean-token-sum-norm"},
    "job": {"steps": 1, "batch_size": 16, "prompt_len": 4, "response_len": LIMIT},
    # Two mini-batches: the old log-prob pass runs, so the rollout holds its log-probs to compare.
    "ppo": {"kl_coef": 0.0, "use_kl_loss": True, "kl_loss_coef": 0.05, "ppo_epochs": 1, "mini_batches": 2},
}
SAME = ("score", "kl", "actor_loss", "actor_kl_loss", "actor_entropy", "actor_grad_norm", "actor_approx_kl")


@pytest.mark.slow  # ~20 s; the cut itself: tests/core/rl/test_rollout_cut.py
@pytest.mark.timeout(300)
def test_a_step_on_responses_cut_to_the_longest_is_the_step_on_the_full_width(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cut = run_one_step(CONFIG, tmp_path / "cut", monkeypatch, MANY_STOPS)
    with monkeypatch.context() as patched:
        patched.setattr(rollout, "cut_to_longest", lambda r: r)
        full = run_one_step(CONFIG, tmp_path / "full", monkeypatch, MANY_STOPS)
    width = max(cut.lengths)
    assert cut.lengths == full.lengths and width < LIMIT and len(set(cut.lengths)) > 1
    assert {len(row) for row in cut.rollout["responses"]} == {width}
    assert {len(row) for row in full.rollout["responses"]} == {LIMIT}
    for key in ("response_len_mean", "response_len_max", "response_clip_frac", "tokens"):
        assert cut.stats[key] == full.stats[key], key
    assert cut.stats["response_len_max"] == width and cut.stats["response_clip_frac"] == 0.0
    for key in SAME:
        assert cut.stats[key] == pytest.approx(full.stats[key], rel=1e-5, abs=1e-8), key
    for key in ("mask", "old_logp", "ref_logp", "rewards", "advantages"):
        ours, theirs = torch.tensor(cut.rollout[key]), torch.tensor(full.rollout[key])
        assert torch.allclose(ours, theirs[:, :width], atol=1e-5), key
    assert not torch.tensor(full.rollout["mask"])[:, width:].any()  # what was cut held no real token
    for name, weight in full.actor.items():
        assert torch.allclose(cut.actor[name], weight, rtol=1e-5, atol=1e-7), name
    infer = {(r["model"], r["tokens"]) for r in cut.rows if r["stage"] == "infer"}
    assert infer == {(r["model"], r["tokens"]) for r in full.rows if r["stage"] == "infer"}
