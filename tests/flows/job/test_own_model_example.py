"""examples/qwen2.5-0.5b-gsm8k.yaml (verl's reference GSM8K PPO run) validates with ``nereus plan``
when its model directory and data files exist: a tiny random Qwen2 and the shipped GSM8K rows stand
in for the downloaded model and verl's files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nereus_core.config import parse_config
from nereus_core.config.from_yaml import parse_yaml
from tests.support.hf_models import write_model, write_tokenizer

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "qwen2.5-0.5b-gsm8k.yaml"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli.main", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_the_example_validates_with_nereus_plan(tmp_path: Path) -> None:
    write_model("qwen2", tmp_path / "qwen2", vocab_size=320, max_position_embeddings=1024)
    write_tokenizer(tmp_path / "qwen2")  # the tokenizer with its chat template, beside the weights
    assert _cli("data", "gsm8k", "--out", str(tmp_path / "gsm8k")).returncode == 0
    sets = [
        f"model.path={tmp_path / 'qwen2'}",
        f"data.train_files=[{tmp_path / 'gsm8k' / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'gsm8k' / 'test.parquet'}]",
    ]
    done = _cli("plan", str(EXAMPLE), *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "config plan plan-" in done.stdout
    # verl's figures, as the example states them.
    raw = parse_yaml(EXAMPLE.read_text())
    assert raw["job"]["batch_size"] == 256 and raw["ppo"]["mini_batches"] == 4  # mini-batch 64
    assert raw["data"]["max_prompt_length"] == raw["data"]["max_response_length"] == 512
    assert (raw["ppo"]["actor_lr"], raw["ppo"]["critic_lr"], raw["ppo"]["kl_coef"]) == (1e-6, 1e-5, 0.001)
    assert raw["model"]["dtype"] == "bf16"


def test_without_the_model_directory_the_example_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as err:
        parse_config(parse_yaml(EXAMPLE.read_text()))
    assert "\n" not in str(err.value) and "models/Qwen2.5-0.5B-Instruct" in str(err.value)
