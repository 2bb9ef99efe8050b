"""Tiny random Hugging Face model directories for tests, written with ``save_pretrained`` (never
downloaded), and a small BPE tokenizer trained in the test on the project's GSM8K text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "data" / "text"
GSM8K_FILES = ("gsm8k_test.jsonl", "gsm8k_test_first500.jsonl")  # the full test split, or its first rows
SIZES = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>"]


def randomize(model: Any, seed: int = 7) -> Any:
    """Every weight random, biases and norms included (HF initialises them to 0 and 1, which would hide
    a bias or norm that is read wrongly)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model.eval()


def write_model(kind: str, path: Path, *, shard: str | None = None, **changes: Any) -> Any:
    """A tiny random ``kind`` model saved to ``path``: ``qwen2`` (tied embeddings, q/k/v biases) or
    ``llama`` (Llama 3 RoPE); ``shard``: save_pretrained's max_shard_size (several files). Returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    sizes = {**SIZES, **changes}
    if kind == "qwen2":
        config = Qwen2Config(
            **sizes, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False
        )
        model = randomize(Qwen2ForCausalLM._from_config(config, attn_implementation="eager"))
    else:
        config = LlamaConfig(
            **sizes, rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=False
        )
        model = randomize(LlamaForCausalLM._from_config(config, attn_implementation="eager"))
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


def corpus(limit: int = 400) -> list[str]:
    """Text to train a tokenizer on: the project's GSM8K questions and answers, or a small inline text
    when the data file is absent."""
    found = [TEXT / name for name in GSM8K_FILES if (TEXT / name).is_file()]
    if not found:
        return [
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
            "How many clips did Natalia sell altogether in April and May? 48 / 2 = 24. 48 + 24 = 72",
        ] * 20
    lines = []
    with found[0].open() as handle:
        for line in handle:
            row = json.loads(line)
            lines.extend(str(row.get(key, "")) for key in ("question", "answer"))
            if len(lines) >= limit:
                break
    return lines


def write_tokenizer(path: Path, *, template: bool = True, vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer trained here on ``corpus()``, wrapped as a fast tokenizer with an
    EOS and (``template``) a chat template, saved to ``path``. Returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    if template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return tokenizer


def directory_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors files (one or several), by name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in path.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """``got`` holds ``expected``'s tensors, all and only those, each of the same dtype and bitwise equal."""
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
