"""A GRPO job on a data set through the job flow: a tiny random Qwen2, a tokenizer trained here with
a chat template, the GSM8K files of ``nereus data gsm8k`` and a ``file.py:function`` reward
(examples/rewards/digit_share.py, the TRL benchmark's).

Each step samples ``batch_size / group_size`` prompts from the data set's sampler; its rollout
holds each prompt ``group_size`` times in adjacent rows, rendered by the chat template and
left-padded; every response is decoded and scored by the function, the score is the rule itself,
and each group's advantages are its rewards relative to the group's mean.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.rewards.digit_share import digit_share
from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from nereus_core.dataset.sampler import Sampler
from nereus_core.hf.tokenizer import chat_prompt_ids, load_tokenizer
from storage.datasets import read_examples
from storage.run_dir import RunDir
from tests.support.hf_models import write_model, write_tokenizer
from tests.support.job_runs import ROOT, gsm8k_files

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

GROUP, PROMPTS, MAX_PROMPT, SEED = 4, 2, 256, 3


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The finished 2-step run, the model directory and the train split."""
    root = tmp_path_factory.mktemp("grpo-data")
    model = root / "qwen2"
    write_model("qwen2", model, vocab_size=320, max_position_embeddings=512)
    write_tokenizer(model)
    train = gsm8k_files(root)["train"]
    cfg = {
        "name": "grpo-gsm8k",
        "cluster": {"devices": 2},
        "model": {"path": str(model)},
        "data": {
            "train_files": [str(train)],
            "max_prompt_length": MAX_PROMPT,
            "max_response_length": 8,
            "seed": SEED,
        },
        "reward": {"function": f"{ROOT / 'examples' / 'rewards' / 'digit_share.py'}:digit_share"},
        "job": {"steps": 2, "batch_size": GROUP * PROMPTS},
        "algorithm": {"name": "grpo", "group_size": GROUP, "scale_rewards": "none"},
        "ppo": {"kl_coef": 0.0, "use_kl_loss": False, "ppo_epochs": 1, "mini_batches": 2},
        "plan": {"actor/generate": {"tp": 2, "devices": [0, 1]}, "actor/train": {"dp": 2, "devices": [0, 1]}},
    }
    out = root / "run"
    rl_job(config=parse_config(cfg), out_dir=str(out))
    return out, model, train


def test_grpo_steps_on_the_data_sets_prompts_in_groups_scored_by_the_function(
    run_dir: tuple[Path, Path, Path],
) -> None:
    out, model, train = run_dir
    assert RunDir(out).read_summary()["status"] == "completed"
    tokenizer = load_tokenizer(model)
    examples = read_examples([train])
    kept = [e for e in examples if len(chat_prompt_ids(tokenizer, [e.chat()])[0]) <= MAX_PROMPT]
    history = RunDir(out).read_rows("metrics/history.parquet")
    for step in (0, 1):
        rollout = RunDir(out).read_rollout(step)
        prompts, prompt_mask = torch.tensor(rollout["prompts"]), torch.tensor(rollout["prompt_mask"])
        assert prompts.shape[0] == GROUP * PROMPTS
        # The step reports its prompts' real tokens (what the controller observes), as verl's prompt_length.
        real = prompt_mask.sum(dim=1).double()
        assert history[step]["prompt_len_mean"] == pytest.approx(float(real.mean()))
        assert history[step]["prompt_len_max"] == float(real.max()) < MAX_PROMPT + 1
        # batch_size / group_size prompts from the sampler, each group_size times side by side.
        chosen = [kept[i] for i in Sampler(len(kept), PROMPTS, seed=SEED).batch(step)]
        for g, ex in enumerate(chosen):
            want = chat_prompt_ids(tokenizer, [ex.chat()])[0]
            for row in range(g * GROUP, (g + 1) * GROUP):
                real = int(prompt_mask[row].sum())
                assert prompts[row, prompts.shape[1] - real :].tolist() == want
                assert prompt_mask[row].tolist() == [0] * (prompts.shape[1] - real) + [1] * real
        # Every response decoded and scored by the function; the score is the rule itself.
        texts, scores = rollout["response_text"], rollout["rule_score"]
        assert scores == [pytest.approx(digit_share("openai/gsm8k", t, "", None)) for t in texts]
        assert rollout["score"] == scores
        assert len(set(scores)) > 1  # the responses differ in score: the advantages below are not all 0
        # scale_rewards none: a response's advantage is its reward minus its group's mean (every token).
        mask = torch.tensor(rollout["mask"])
        adv = torch.tensor(rollout["advantages"])
        reward = torch.tensor(scores).view(PROMPTS, GROUP)
        expected = (reward - reward.mean(dim=1, keepdim=True)).view(-1, 1).expand_as(adv)
        torch.testing.assert_close(adv * mask, expected * mask)
