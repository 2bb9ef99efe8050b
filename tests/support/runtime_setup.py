"""What the runtime tests share: the tiny GQA model, the layout of given degrees, and the log-prob of
each next token under a model's logits."""

from __future__ import annotations

import torch

from nereus_core.config import ModelConfig
from nereus_core.layout import Layout

# 8 query heads / 4 KV heads so that tp=4 still splits the KV heads (GQA kept).
GQA_MODEL = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    seed=7,
)


def contiguous_layout(tp: int, pp: int, dp: int) -> Layout:
    """The contiguous layout of these degrees, with two micro-batches when it pipelines."""
    return Layout.contiguous(tp=tp, pp=pp, dp=dp, micro_batches=2 if pp > 1 else 1)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[b, s-1]``: the log-prob of each token of ``ids`` after the first, from the logits before it."""
    return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
