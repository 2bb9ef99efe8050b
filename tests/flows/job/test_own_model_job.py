"""``nereus run`` on a user's own model, data and reward: a tiny random Qwen2 written with
``save_pretrained``, a BPE tokenizer trained here with a chat template, the GSM8K files made by
``nereus data gsm8k`` and the ``gsm8k`` rule reward.

The run completes; its rollouts hold the sampler's prompts rendered by the chat template and
left-padded, the responses decoded and scored by the reward; the old log-probs it stored equal
transformers' on the actor exported at that step; validation is logged under verl's names; the
tables carry the response lengths. A reward function that raises fails the step with its message,
the last checkpoint intact. The slow variants add a live and a durable switch, each verified
bitwise, and a resume after the driver is killed, with the same checks after them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flows.job.rl_job import rl_job
from nereus_core import rewards
from nereus_core.config import parse_config
from nereus_core.dataset.sampler import Sampler
from nereus_core.engine.forward import position_ids
from nereus_core.hf.tokenizer import chat_prompt_ids, load_tokenizer
from storage import read_full_state
from storage.datasets import read_examples
from storage.export import export_hf
from storage.run_dir import STEPS_TABLE, RunDir
from tests.support.hf_models import write_model, write_tokenizer
from tests.support.job_configs import MAX_PROMPT
from tests.support.job_configs import qwen2_gsm8k_config as config
from tests.support.job_runs import gsm8k_files, kill_after_checkpoint, resume, start_run

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

VAL_KEY = "val-core/openai/gsm8k/reward/mean@1"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("own")
    model = root / "qwen2"
    write_model("qwen2", model, vocab_size=320, max_position_embeddings=512)
    write_tokenizer(model)  # 300 tokens: the model's 320 rows take every id
    return {"model": model, **gsm8k_files(root)}


def run(files: dict[str, Path], out: Path, **job: Any) -> Path:
    rl_job(config=parse_config(config(files, **job)), out_dir=str(out))
    return out


def check_rollout(files: dict[str, Path], run_dir: Path, step: int, tmp_path: Path) -> None:
    """Rollout ``step``: the sampler's prompts, decoded and scored responses, and old log-probs equal
    to transformers' on the actor exported at ``step`` (the state that generated it), within 1e-4."""
    from transformers import Qwen2ForCausalLM

    tokenizer = load_tokenizer(files["model"])
    rollout = RunDir(run_dir).read_rollout(step)
    prompts, responses = torch.tensor(rollout["prompts"]), torch.tensor(rollout["responses"])
    prompt_mask = (
        torch.tensor(rollout["prompt_mask"]) if "prompt_mask" in rollout else torch.ones_like(prompts)
    )
    mask = torch.tensor(rollout["mask"])
    # The prompts are the sampler's batch of this step, rendered by the chat template, left-padded.
    examples = [e for e in read_examples([files["train"]])]
    kept = [e for e in examples if len(chat_prompt_ids(tokenizer, [e.chat()])[0]) <= MAX_PROMPT]
    rows = [kept[i] for i in Sampler(len(kept), 8, seed=3).batch(step)]
    reals = prompt_mask.sum(1).tolist()
    for row, ids, real, ex in zip(prompts.tolist(), prompt_mask.tolist(), reals, rows, strict=True):
        assert row[len(row) - real :] == chat_prompt_ids(tokenizer, [ex.chat()])[0]
        assert ids == [0] * (len(row) - real) + [1] * real
    # Responses decoded up to their own length and scored by the gsm8k rule.
    lengths = mask.sum(1).long().tolist()
    assert rollout["response_length"] == lengths
    for text, resp, n, ex, score in zip(
        rollout["response_text"], responses.tolist(), lengths, rows, rollout["rule_score"], strict=True
    ):
        assert text == tokenizer.decode(resp[:n], skip_special_tokens=True)
        assert score == rewards.resolve("gsm8k").fn(ex.data_source, text, ex.ground_truth, ex.extra_info)
    assert rollout["score"] == rollout["rule_score"]  # no reward model: the rule is the score
    # Old log-probs against transformers on the exported actor, left padding and positions as generate's.
    export_hf(run_dir, model="actor", step=step, out=tmp_path / f"actor-{step}")
    hf = Qwen2ForCausalLM.from_pretrained(tmp_path / f"actor-{step}", dtype=torch.float32).eval()
    ids, attention = torch.cat([prompts, responses], 1), torch.cat([prompt_mask, mask.long()], 1)
    with torch.no_grad():
        logits = hf(ids, attention_mask=attention, position_ids=position_ids(attention)).logits
    logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    t = responses.shape[1]
    diff = ((logp[:, -t:] - torch.tensor(rollout["old_logp"])) * mask).abs().max().item()
    assert diff <= 1e-4, diff


def check_tables(run_dir: Path, steps: int, limit: int = 16) -> None:
    history = RunDir(run_dir).read_rows("metrics/history.parquet")
    assert [h["step"] for h in history] == list(range(steps))
    for h in history:
        assert 0 < h["response_len_mean"] <= h["response_len_max"] <= limit
        assert 0 <= h["response_clip_frac"] <= 1
        validated = (h["step"] + 1) % 2 == 0 or h["step"] == steps - 1
        assert (h.get(VAL_KEY) is not None) == validated, h["step"]
        if validated:
            assert 0.0 <= h[VAL_KEY] <= 1.0 and h["val_s"] > 0
    rows = RunDir(run_dir).read_rows(STEPS_TABLE)
    stages = {(r["model"], r["stage"]) for r in rows}
    assert ("reward", "infer") not in stages  # a rule reward: the reward model never runs
    for r in rows:
        (h,) = [h for h in history if h["step"] == r["step"]]
        assert r["response_len_mean"] == h["response_len_mean"]
        assert r["response_clip_frac"] == h["response_clip_frac"]


def test_own_qwen2_on_gsm8k_with_the_gsm8k_reward(files: dict[str, Path], tmp_path: Path) -> None:
    out = run(files, tmp_path / "run")
    summary = RunDir(out).read_summary()
    assert summary["status"] == "completed" and summary["steps"] == 2
    check_tables(out, 2)
    check_rollout(files, out, 1, tmp_path)


RAISES_ON_STEP_1 = """
calls = {"n": 0}


def score(data_source, solution_str, ground_truth, extra_info):
    calls["n"] += 1
    if calls["n"] > 9:  # the job's worker: step 0's 8 rows, step 1's first; its second raises
        raise KeyError("no answer field")
    return 0.0
"""


def test_a_reward_function_that_raises_fails_the_step_and_keeps_the_checkpoint(
    files: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "my_reward.py").write_text(RAISES_ON_STEP_1)
    cfg = config(files)
    cfg["reward"] = {"function": f"{tmp_path / 'my_reward.py'}:score"}
    cfg["validation"] = {"every": 0}
    out = tmp_path / "run"
    with pytest.raises(rewards.RewardError) as err:
        rl_job(config=parse_config(cfg), out_dir=str(out))
    log = out / "logs" / "reward_worker.log"  # the job's reward worker writes into the run directory
    assert str(err.value).startswith(
        f"reward function {tmp_path / 'my_reward.py'}:score raised KeyError: 'no answer field' "
        f"(worker log: {log}) (on data row "
    )
    assert "KeyError: 'no answer field'" in log.read_text()  # with its traceback
    run = RunDir(out)
    assert run.latest_checkpoint()["step"] == 1  # the state after step 0: the resume point, intact
    assert read_full_state(out, "actor", step=1)
    assert (out / "rollouts" / "step=0.parquet").exists() and not (
        out / "rollouts" / "step=1.parquet"
    ).exists()
    assert not (out / "summary.json").exists()


# 44 MiB per slot (39.6 usable) fits the first plan at 16-token responses (30 MiB by the cost model)
# but not at 64 (40.6 MiB): the response-length event forces a live switch; two slots joining
# before step 2 force a durable one.
SWITCHES = {
    "steps": 4,
    "scenario": [{"step": 1, "response_len": 64}, {"step": 2, "devices": 4}],
    "verify_transitions": True,
}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_own_qwen2_on_gsm8k_through_a_live_and_a_durable_switch(
    files: dict[str, Path], tmp_path: Path
) -> None:
    cfg = config(files, **SWITCHES)
    cfg["cluster"]["memory_per_device"] = "44MiB"
    rl_job(config=parse_config(cfg), out_dir=str(tmp_path / "run"))
    out = tmp_path / "run"
    summary = RunDir(out).read_summary()
    assert summary["status"] == "completed" and summary["transitions"] == 2
    rows = RunDir(out).read_rows("metrics/transitions.parquet")
    assert [(r["route"], r["status"], r["verified_bitwise"]) for r in rows] == [
        ("live", "committed", True),
        ("durable", "committed", True),
    ]
    check_tables(out, 4, limit=64)
    check_rollout(files, out, 1, tmp_path)  # generated on the plan the live switch moved the state to
    check_rollout(files, out, 3, tmp_path)  # and on the one after the durable switch


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_own_qwen2_on_gsm8k_resumes_after_a_kill(files: dict[str, Path], tmp_path: Path) -> None:
    driver, out = start_run(tmp_path, config(files, steps=4))
    kill_after_checkpoint(driver, out, 2, tmp_path, limit_s=300.0)  # as soon as step 2's is complete
    resume(tmp_path, out)
    summary = RunDir(out).read_summary()
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 2
    check_tables(out, 4)
    check_rollout(files, out, 2, tmp_path)  # the resumed job's first step: the sampler's batch 2
