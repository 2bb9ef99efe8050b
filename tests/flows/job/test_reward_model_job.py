"""``nereus run`` with ``reward.model_path``: a tiny random Qwen2 actor, a tiny random one-label
``Qwen2ForSequenceClassification`` reward model (of the actor's shapes, or wider and deeper: a reward
model needs only the actor's vocabulary), a tokenizer trained here and the GSM8K files made by
``nereus data gsm8k``.

Every stored score equals transformers' sequence-classification score of the stored rollout (its ids
and attention mask: left-padded prompts, right-padded responses) within 1e-4; the ``gsm8k`` rule is
still computed and stored as ``rule_score``; the reward model runs as reward/infer and nothing is fitted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from nereus_core.engine.forward import position_ids
from storage.run_dir import STEPS_TABLE, RunDir
from tests.support.hf_models import SIZES, randomize, write_model, write_tokenizer
from tests.support.job_configs import qwen2_gsm8k_config as config
from tests.support.job_runs import gsm8k_files

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

SHAPES = {**SIZES, "vocab_size": 320, "max_position_embeddings": 512}


# A reward model of shapes of its own: wider, deeper, other heads; the actor's vocabulary.
OWN_SHAPES = {**SHAPES, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3}
OWN_SHAPES |= {"num_attention_heads": 6, "num_key_value_heads": 3}


def write_reward_model(path: Path, pad_token_id: int, shapes: dict[str, int]) -> None:
    """A random one-label Qwen2 sequence classifier of ``shapes``, with weights of its own."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    hf_config = Qwen2Config(
        **shapes,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        num_labels=1,
        pad_token_id=pad_token_id,
    )
    model = Qwen2ForSequenceClassification._from_config(hf_config, attn_implementation="eager")
    randomize(model, seed=23).save_pretrained(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rm")
    model = root / "qwen2"
    write_model("qwen2", model, vocab_size=320, max_position_embeddings=512)
    tokenizer = write_tokenizer(model)
    # Forty more end-of-turn ids: responses stop early, so the rollouts are right-padded (a row runs to
    # the 16-token limit with probability about 0.12 under near-uniform sampling).
    stops = [tokenizer.eos_token_id, *range(280, 320)]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    write_reward_model(root / "reward", pad_token_id=tokenizer.eos_token_id, shapes=SHAPES)
    write_reward_model(root / "reward-own-shapes", pad_token_id=tokenizer.eos_token_id, shapes=OWN_SHAPES)
    return {
        "model": model,
        "reward": root / "reward",
        "reward-own-shapes": root / "reward-own-shapes",
        **gsm8k_files(root),
    }


def transformers_scores(reward_dir: Path, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Transformers' pooled score of each row at its last real token by ``attention``.

    Transformers pools at the rightmost token that is not ``pad_token_id``; the stored rows pad with the
    tokenizer's pad id, which is also its EOS, a real token that ends a response. So the masked
    positions are filled with an id that no real token of these rows uses, set as the pad id: the
    pooled token is then the last one the attention mask keeps (where verl reads a reward model's score).
    """
    from transformers import Qwen2ForSequenceClassification

    hf = Qwen2ForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32).eval()
    used = set(ids[attention.bool()].tolist())
    pad = next(i for i in range(hf.config.vocab_size) if i not in used)
    hf.config.pad_token_id = pad
    filled = torch.where(attention.bool(), ids, torch.full_like(ids, pad))
    with torch.no_grad():
        logits = hf(filled, attention_mask=attention, position_ids=position_ids(attention)).logits
    assert logits.shape == (ids.shape[0], 1)
    return logits[:, 0]


@pytest.mark.parametrize("reward", ["reward", "reward-own-shapes"])
def test_the_reward_model_scores_each_rollout_as_transformers_does(
    files: dict[str, Path], tmp_path: Path, reward: str
) -> None:
    data = config(files, steps=2, snapshot_every=0)
    data["reward"] = {"function": "gsm8k", "model_path": str(files[reward])}
    data["validation"] = {"every": 0}
    data["plan"]["reward/infer"] = {"devices": [0]}
    cfg = parse_config(data)
    assert "reward/infer" in cfg.stages
    assert cfg.models["reward"].hidden_size == (
        48 if reward == "reward-own-shapes" else SHAPES["hidden_size"]
    )
    summary = rl_job(config=cfg, out_dir=str(tmp_path / "run"))
    assert summary["reward_fit"] == {"first_mse": None, "last_mse": None}  # loaded, not fitted
    run = RunDir(tmp_path / "run")
    for step in range(2):
        rollout = run.read_rollout(step)
        prompts, responses = torch.tensor(rollout["prompts"]), torch.tensor(rollout["responses"])
        mask = torch.tensor(rollout["mask"]).long()
        assert (mask[:, :-1] >= mask[:, 1:]).all() and not mask[:, -1].all()  # right-padded responses
        assert mask.sum(1).unique().numel() > 1  # the last real tokens lie in different columns
        ids = torch.cat([prompts, responses], 1)
        attention = torch.cat([torch.tensor(rollout["prompt_mask"]), mask], 1)
        expected = transformers_scores(files[reward], ids, attention)
        score = torch.tensor(rollout["score"])
        diff = (score - expected).abs().max().item()
        assert diff <= 1e-4, (step, diff)
        assert expected.std() > 0
        # The rule still runs (its scores kept beside the reward model's): gsm8k's strict scorer gives
        # 0 or 1, never the reward model's value.
        rule = torch.tensor(rollout["rule_score"])
        assert set(rule.tolist()) <= {0.0, 1.0} and not torch.equal(rule, score)
    stages = {(r["model"], r["stage"]) for r in run.read_rows(STEPS_TABLE)}
    assert ("reward", "infer") in stages
