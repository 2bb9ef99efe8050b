"""The data, validation and reward config sections: defaults, and each refusal as one line at load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nereus_core.config import ConfigError, parse_config
from nereus_core.plan import ModelStage
from tests.support.data_files import TOKENIZER, files

BIG_MODEL = {"max_position_embeddings": 2048}


def load(**sections: Any) -> Any:
    model = dict(BIG_MODEL)
    if "data" in sections:  # chat prompts need a tokenizer with a template, and a text reward
        sections.setdefault("reward", {"function": "gsm8k"})
        model["tokenizer"] = TOKENIZER
    return parse_config({"model": model, **sections})


def one_line_error(**sections: Any) -> str:
    with pytest.raises(ConfigError) as err:
        load(**sections)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_sections_are_optional() -> None:
    cfg = parse_config({})
    assert cfg.data is None and cfg.validation is None and cfg.reward is None


def test_data_defaults_and_one_file(tmp_path: Path) -> None:
    train, val = files(tmp_path)
    cfg = load(data={"train_files": train, "val_files": [val]}, reward={"function": "gsm8k"})
    assert cfg.data.train_files == (train,) and cfg.data.val_files == (val,)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (512, 512)
    assert (cfg.data.truncation, cfg.data.shuffle, cfg.data.seed) == ("filter", True, 0)
    assert cfg.reward.resolve().name == "gsm8k"


def test_missing_and_wrong_files_refused(tmp_path: Path) -> None:
    train, _ = files(tmp_path)
    line = one_line_error(data={"train_files": [train, str(tmp_path / "gone.parquet")]})
    assert line.startswith("data.train_files: file 1: ") and "does not exist" in line
    assert "nereus data gsm8k|math500" in line
    line = one_line_error(data={"train_files": [str(tmp_path / "rows.csv")]})
    assert "is not a .parquet or .jsonl file" in line
    (tmp_path / "d.parquet").mkdir()
    assert "is a directory" in one_line_error(data={"train_files": [str(tmp_path / "d.parquet")]})
    assert "names a file twice" in one_line_error(data={"train_files": [train, train]})
    assert one_line_error(data={}).startswith("data.train_files: required field is missing")
    assert "data.train_files" in one_line_error(data={"train_files": []})


def test_truncation_and_lengths(tmp_path: Path) -> None:
    train, _ = files(tmp_path)
    line = one_line_error(data={"train_files": train, "truncation": "left"})
    assert line.startswith("data.truncation=") and "filter" in line and "error" in line
    line = one_line_error(data={"train_files": train, "max_prompt_length": 2000})
    assert line.startswith("data.max_prompt_length+data.max_response_length=2512 exceeds")


def test_validation_needs_val_files(tmp_path: Path) -> None:
    train, val = files(tmp_path)
    line = one_line_error(data={"train_files": train}, validation={"every": 5})
    assert line.startswith("validation is on but data.val_files is empty")
    cfg = load(data={"train_files": train, "val_files": val}, validation={"every": 5, "before_train": True})
    assert cfg.validation.every == 5 and cfg.validation.batch_size is None
    assert load(validation={"every": 0}).validation.before_train is False


def test_reward_function_checked_at_load(tmp_path: Path) -> None:
    train, _ = files(tmp_path)
    data = {"train_files": train}
    assert one_line_error(data=data, reward={"function": "gsm9k"}).startswith(
        "reward.function: is neither a built-in (gsm8k, gsm8k_flexible, math, count)"
    )
    assert "does not exist" in one_line_error(data=data, reward={"function": f"{tmp_path}/r.py:f"})
    (tmp_path / "r.py").write_text("def g(a, b, c, d):\n    return 1.0\nh = None\n")
    assert "has no function 'f'" in one_line_error(data=data, reward={"function": f"{tmp_path}/r.py:f"})
    assert "is a NoneType, not a function" in one_line_error(
        data=data, reward={"function": f"{tmp_path}/r.py:h"}
    )
    assert load(data=data, reward={"function": f"{tmp_path}/r.py:g"}).reward.resolve().inputs == "text"


def test_reward_kind_must_match_the_data(tmp_path: Path) -> None:
    train, _ = files(tmp_path)
    line = one_line_error(data={"train_files": train}, reward={"function": "count"})
    assert line.startswith("reward.function=count scores the demo's token ids")
    assert "give data.train_files" in one_line_error(reward={"function": "math"})
    assert load(reward={"function": "count"}).reward.function == "count"
    line = one_line_error(data={"train_files": train}, reward=None)
    assert line.startswith("data needs a reward: set reward.function (gsm8k") and "file.py" in line


def test_the_job_lengths_follow_the_data_section(tmp_path: Path) -> None:
    train, _ = files(tmp_path)
    cfg = load(data={"train_files": train, "max_prompt_length": 300, "max_response_length": 40})
    assert (cfg.job.prompt_len, cfg.job.response_len) == (300, 40)
    assert not cfg.uses_reward_model  # a rule on text: no reward model, no reward/infer stage
    assert ModelStage.REWARD_INFER not in cfg.stages and ModelStage.CRITIC_TRAIN in cfg.stages
    assert load().uses_reward_model and ModelStage.REWARD_INFER in load().stages  # count's fitted one
    line = one_line_error(data={"train_files": train}, job={"response_len": 8})
    assert line.startswith("job.response_len=8 differs from data.max_response_length=512")


def test_data_needs_a_tokenizer_with_a_chat_template(tmp_path: Path) -> None:
    train, _ = files(tmp_path)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_text("{}")
    sections = {"data": {"train_files": train}, "reward": {"function": "gsm8k"}}
    with pytest.raises(ConfigError) as err:
        parse_config(sections)
    assert str(err.value) == "data needs a tokenizer: set model.path (a model directory) or model.tokenizer"
    with pytest.raises(ConfigError) as err:
        parse_config({**sections, "model": {"tokenizer": str(plain)}})
    assert "has no chat template" in str(err.value) and "\n" not in str(err.value)


def test_reward_model_path_is_a_model_directory(tmp_path: Path) -> None:
    line = one_line_error(reward={"model_path": str(tmp_path / "none")})
    assert line.startswith("reward.model_path: ") and "is not a directory" in line
    line = one_line_error(
        reward={"model_path": str(tmp_path)}
    )  # the checks of tests/core/hf/test_hf_files.py
    assert line.startswith("reward.model_path: ") and "config.json not found" in line
