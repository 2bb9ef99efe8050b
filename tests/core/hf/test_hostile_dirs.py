"""Broken model directories and tokenizers (tests/support/hostile_inputs.py) against
nereus_core/hf and nereus_core/model/hf_dir.py: each refused in one line naming the file and tensor
(or the template), before any device work."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus_core.config import ConfigError, parse_config
from nereus_core.hf.tokenizer import TokenizerError, chat_prompt_ids, load_tokenizer, stop_token_ids
from nereus_core.model.hf_dir import read_hf_config, weights_problem
from tests.support.hf_models import write_model, write_tokenizer
from tests.support.hostile_inputs import ROW, model_cases

TOKENIZER_CASES = ("template-raises", "template-loops", "template-empty", "no-eos")
CONFIG_CASES = ("layers-1e9", "model-type", "architecture")


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    root = tmp_path_factory.mktemp("hostile")
    write_model("llama", root / "llama", vocab_size=320)
    write_tokenizer(root / "llama")
    return model_cases(root)


def test_the_base_directory_passes(cases: dict[str, tuple[Path, str]]) -> None:
    base = next(iter(cases.values()))[0].parent / "llama"
    assert weights_problem(base, read_hf_config(base)) is None


@pytest.mark.parametrize("name", CONFIG_CASES)
def test_bad_config_json_is_refused_at_config_load(cases: dict[str, tuple[Path, str]], name: str) -> None:
    path, needle = cases[name]
    with pytest.raises(ConfigError) as err:
        parse_config({"model": {"path": str(path)}})
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "name",
    [
        "truncated",
        "header-damaged",
        "header-oversized",
        "missing-tensor",
        "wrong-shape",
        "wrong-dtype",
        "symlink-outside",
        "index-outside",
    ],
)
def test_bad_weights_are_one_line_naming_file_and_tensor(
    cases: dict[str, tuple[Path, str]], name: str
) -> None:
    path, needle = cases[name]
    problem = weights_problem(path, read_hf_config(cases["layers-1e9"][0].parent / "llama"))
    assert problem is not None and needle in problem and "\n" not in problem, problem
    assert str(path) in problem


def test_bad_templates_and_no_eos_are_one_line(cases: dict[str, tuple[Path, str]]) -> None:
    for name in TOKENIZER_CASES:
        path, needle = cases[name]
        tokenizer = load_tokenizer(path)
        with pytest.raises(TokenizerError) as err:
            if name == "no-eos":
                stop_token_ids(tokenizer, path)
            else:
                chat_prompt_ids(tokenizer, [ROW["prompt"]])
        assert needle in str(err.value) and "\n" not in str(err.value), (name, err.value)
