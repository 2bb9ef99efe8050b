"""What a rollout engine is asked and how its answers become the rollout's tensors.

An engine that takes prompts as token lists (vLLM) gets each row's real prompt ids (the left pads
stripped) and one ``SamplingRequest`` per call; it answers with each row's sampled ids and their
log-probs, which ``response_tensors`` pads back to the ``[b, T]`` layout Nereus's own sampler
returns (right-padded with ``pad_id``; ``rl.rollout.response_mask`` marks the real tokens). GRPO's
group of ``n`` copies of one prompt is asked once with ``n`` samples (``distinct_prompts``), as
verl and OpenRLHF ask vLLM.

The log-probs are the model's own (the raw logits' log-softmax: vLLM's ``raw_logprobs``, before
temperature or top-p), the same quantity the train layout recomputes as the old log-probs.

Boundary: plain data and tensors; no engine is imported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

SEED_STRIDE = 1_000_003  # seeds of two rows (or replicas) never meet


@dataclass(frozen=True)
class SamplingRequest:
    """The sampling settings of one generate call (the job's, as ``stages.generate`` passes them)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    seed: int = 0
    n: int = 1

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.n < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} and n={self.n} must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature={self.temperature} must be >= 0, top_p={self.top_p} in (0, 1]")

    def params(self, row: int) -> dict[str, Any]:
        """Keyword arguments of ``vllm.SamplingParams`` for prompt ``row`` (its own seed). Without stop
        ids every response runs to ``max_new_tokens`` (``ignore_eos``), as Nereus's sampler does."""
        return {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_new_tokens,
            "min_tokens": 0,
            "stop_token_ids": list(self.stop_ids),
            "ignore_eos": not self.stop_ids,
            "logprobs": 0,  # the sampled token's log-prob only
            "seed": self.seed * SEED_STRIDE + row,
            "detokenize": False,
            "skip_special_tokens": False,
        }


def prompt_lists(prompts_bs: torch.Tensor, prompt_mask_bs: torch.Tensor | None) -> list[list[int]]:
    """Each row's real prompt ids (a left-padded row without its pads)."""
    if prompt_mask_bs is None:
        return [row.tolist() for row in prompts_bs]
    return [row[mask.bool()].tolist() for row, mask in zip(prompts_bs, prompt_mask_bs, strict=True)]


def distinct_prompts(prompts: Sequence[list[int]], group: int) -> list[list[int]] | None:
    """The first row of each run of ``group`` equal rows (GRPO's copies side by side), or None when
    the rows are not such runs (then each row is asked once with ``n=1``)."""
    if group <= 1 or len(prompts) % group:
        return None
    firsts = [prompts[i] for i in range(0, len(prompts), group)]
    for i, row in enumerate(prompts):
        if row != firsts[i // group]:
            return None
    return firsts


def response_tensors(
    samples: Sequence[tuple[Sequence[int], Sequence[float]]], max_new_tokens: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [b, T] int64, logp [b, T] float32)`` from each row's (sampled ids, their log-probs): ids
    right-padded with ``pad_id``, log-probs with 0."""
    ids_bt = torch.full((len(samples), max_new_tokens), pad_id, dtype=torch.int64)
    logp_bt = torch.zeros((len(samples), max_new_tokens), dtype=torch.float32)
    for row, (ids, logps) in enumerate(samples):
        if len(ids) > max_new_tokens or len(logps) != len(ids):
            raise ValueError(
                f"row {row}: {len(ids)} ids and {len(logps)} log-probs for at most {max_new_tokens} tokens"
            )
        ids_bt[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.int64)
        logp_bt[row, : len(ids)] = torch.tensor(list(logps), dtype=torch.float32)
    return ids_bt, logp_bt
