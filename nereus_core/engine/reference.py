"""The single-device reference: the whole model in one process, no parallelism.

Parallel layouts are checked against it (and it against Hugging Face
transformers in the tests).
"""

from __future__ import annotations

import torch

from nereus_core.config import ModelConfig
from nereus_core.model.llama import LlamaStage
from nereus_core.model.tensor_parallel import vocab_parallel_argmax, vocab_parallel_logprobs
from nereus_core.model.weights import init_full_state


def reference_model(config: ModelConfig) -> LlamaStage:
    stage = LlamaStage(config, layers=range(config.num_hidden_layers), first=True, last=True)
    stage.load_full_state(init_full_state(config))
    return stage.eval()


@torch.no_grad()
def reference_logprobs(model: LlamaStage, ids_bs: torch.Tensor) -> torch.Tensor:
    logits = model(ids_bs, torch.arange(ids_bs.shape[1]))
    return vocab_parallel_logprobs(logits[:, :-1], ids_bs[:, 1:], None)


@torch.no_grad()
def reference_greedy(model: LlamaStage, prompts_bs: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy tokens ``[b, max_new_tokens]`` with a KV cache."""
    b, prompt_len = prompts_bs.shape
    cache = model.new_cache(b, prompt_len + max_new_tokens)
    ids, start, out = prompts_bs, 0, []
    for _ in range(max_new_tokens):
        logits = model(ids, torch.arange(start, start + ids.shape[1]), cache)
        start += ids.shape[1]
        ids = vocab_parallel_argmax(logits[:, -1], None)[:, None]
        out.append(ids)
    return torch.cat(out, dim=1)
