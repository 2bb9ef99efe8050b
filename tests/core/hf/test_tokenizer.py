"""nereus_core/hf/tokenizer.py: a BPE tokenizer trained here on the project's GSM8K text (a small inline
text when the data file is absent), saved with a chat template, loaded back through ``model.tokenizer``
/ ``model.path``; chat prompts rendered to ids, the ids that stop generation, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus_core.config import parse_config
from nereus_core.hf.tokenizer import (
    TokenizerError,
    chat_prompt_ids,
    chat_template_error,
    load_tokenizer,
    stop_token_ids,
)
from tests.support.hf_models import corpus, write_model, write_tokenizer

CHAT = [
    [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "What is 48 / 2 + 48?"}],
    [{"role": "user", "content": "How many clips did Natalia sell?"}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with its tokenizer beside the weights (``model.tokenizer`` defaults to it)."""
    path = tmp_path_factory.mktemp("hf") / "llama"
    write_model("llama", path)
    write_tokenizer(path)
    return path


def test_the_tokenizer_is_loaded_from_model_path_and_renders_chat_prompts(model_dir: Path) -> None:
    cfg = parse_config({"model": {"path": str(model_dir)}})
    assert cfg.model.tokenizer_dir == str(model_dir)
    tokenizer = load_tokenizer(cfg.model.tokenizer_dir)
    assert len(tokenizer) > 256 + 5  # the byte alphabet, the special tokens and merges learned here
    text = corpus()[0]
    assert len(tokenizer(text)["input_ids"]) < len(text.encode())  # the merges compress the text
    ids = chat_prompt_ids(tokenizer, CHAT)
    expected = [
        "<|system|>Solve it.<|end|><|user|>What is 48 / 2 + 48?<|end|><|assistant|>",
        "<|user|>How many clips did Natalia sell?<|end|><|assistant|>",
    ]
    for got, text in zip(ids, expected, strict=True):
        assert got == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(got) == text
        assert got[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")  # the assistant's turn is open
    assert chat_template_error(cfg.model.tokenizer_dir) is None


def test_stop_ids_are_the_eos_and_the_generation_configs(model_dir: Path, tmp_path: Path) -> None:
    from transformers import GenerationConfig

    tokenizer = load_tokenizer(model_dir)
    eos, end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|end|>"])
    assert stop_token_ids(tokenizer, None) == (eos,)
    assert stop_token_ids(tokenizer, tmp_path) == (eos,)  # no generation_config.json there
    GenerationConfig(eos_token_id=[end, eos]).save_pretrained(tmp_path)
    assert stop_token_ids(tokenizer, tmp_path) == (eos, end)
    GenerationConfig(eos_token_id=end).save_pretrained(tmp_path)
    assert stop_token_ids(tokenizer, tmp_path) == (eos, end)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(TokenizerError, match=r"eos_token_id='x' is not a token id"):
        stop_token_ids(tokenizer, tmp_path)


def test_a_separate_tokenizer_directory_and_one_line_errors(model_dir: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    write_tokenizer(plain, template=False)
    cfg = parse_config({"model": {"path": str(model_dir), "tokenizer": str(plain)}})
    assert cfg.model.tokenizer_dir == str(plain)
    tokenizer = load_tokenizer(cfg.model.tokenizer_dir)
    problem = chat_template_error(plain)
    assert problem is not None and "has no chat template" in problem and "\n" not in problem
    with pytest.raises(TokenizerError, match="has no chat template, but the prompts are chat messages"):
        chat_prompt_ids(tokenizer, CHAT)
    for missing in (tmp_path / "absent", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(TokenizerError) as info:
            load_tokenizer(missing)
        assert "\n" not in str(info.value) and (
            "not found" in str(info.value) or "no tokenizer files" in str(info.value)
        )
        assert chat_template_error(missing) == str(info.value)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="the tokenizer does not load") as info:
        load_tokenizer(tmp_path / "broken")
    assert "\n" not in str(info.value)
