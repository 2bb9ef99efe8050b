"""Peak memory of an actor's train step per token: the log-softmax formula against the chunked log-probs.

One tiny Llama ``LlamaStage`` (one decoder layer, hidden 64) with a large vocabulary, on CPU, so
the ``[tokens, V]`` logits dominate the step's memory as they do a real actor's. Per variant,
side by side in one process, one actor-style step: logits -> log-probs of the next tokens ->
masked mean loss (``engine.train.lm_loss``) -> backward; and the no-grad entropy statistic.

- ``formula``: ``torch.log_softmax(logits.float()).gather(...)``, the former single-device
  ``vocab_parallel_logprobs`` (kept here only as the reference), and the former one-pass entropy;
- ``chunked``: ``model.tensor_parallel.vocab_parallel_logprobs`` / ``vocab_parallel_entropy``.

Memory is measured with ``torch.profiler.profile(profile_memory=True)``: every allocation and free
of the CPU allocator inside the step is an event with its byte count, and the peak is the largest
running sum of those events in time order, i.e. the most bytes the step held at once beyond what
existed before it (weights and inputs). Seconds are wall time without the profiler. The log-probs,
loss and parameter gradients of the two variants are checked to agree before anything is reported.

With ``--dtype bf16`` the stage computes in bf16 and its head upcasts the logits to fp32
(``LlamaStage``), so both variants are given fp32 logits as in a bf16 actor.

    python -m benchmarks.bench_logprob_memory [--vocab 32000] [--batch 4] [--seq 1025]
        [--dtype fp32|bf16] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from nereus_core.config import ModelConfig
from nereus_core.engine.train import lm_loss
from nereus_core.model import LlamaStage, init_full_state
from nereus_core.model.tensor_parallel import vocab_parallel_entropy, vocab_parallel_logprobs

LogprobFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def formula_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def chunked_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_logprobs(logits, targets, None)


@torch.no_grad()
def formula_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def chunked_entropy(logits: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_entropy(logits, None)


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """The most bytes allocated at once while ``fn`` runs (CPU allocator events), and its result."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, result


def train_step(stage: LlamaStage, batch: dict[str, torch.Tensor], logprobs: LogprobFn) -> dict[str, Any]:
    """One actor step's forward and backward; the logits are dropped once the loss exists, as
    ``engine.train.train_step`` does, so only the autograd graph holds what it saved."""
    stage.zero_grad(set_to_none=True)
    ids = batch["ids"]
    logits = stage(ids, torch.arange(ids.shape[1]))
    logp = logprobs(logits[:, :-1], ids[:, 1:])
    del logits
    loss = lm_loss(logp, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in stage.named_parameters()}
    return {"logprobs": logp.detach(), "loss": loss.detach(), "grads": grads}


def _check_agree(formula: dict[str, Any], chunked: dict[str, Any]) -> None:
    torch.testing.assert_close(chunked["logprobs"], formula["logprobs"], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(chunked["loss"], formula["loss"])
    for name, grad in formula["grads"].items():
        # fp32: within rounding; bf16 parameters: torch's bf16 tolerances (a rounding flip of a bf16 grad)
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if grad.dtype == torch.float32 else {}
        torch.testing.assert_close(chunked["grads"][name], grad, msg=name, **tolerance)


def _stage_and_batch(
    vocab: int, batch: int, seq: int, dtype: str
) -> tuple[LlamaStage, dict[str, torch.Tensor]]:
    cfg = ModelConfig(
        dtype=dtype,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    stage = LlamaStage(cfg, layers=range(1), first=True, last=True)
    stage.load_full_state(init_full_state(cfg))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq)
    mask[:, : seq // 4] = 0.0  # a prompt: no loss on it, as an actor's response mask
    return stage, {"ids": ids, "mask": mask}


def _seconds(fn: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run(vocab: int, batch: int, seq: int, repeats: int, dtype: str = "fp32") -> dict[str, Any]:
    stage, data = _stage_and_batch(vocab, batch, seq, dtype)
    tokens = batch * (seq - 1)
    logits = stage(data["ids"], torch.arange(seq)).detach()[:, :-1]
    variants = {
        "formula": (formula_logprobs, formula_entropy),
        "chunked": (chunked_logprobs, chunked_entropy),
    }
    results, outputs = {}, {}
    for name, (logprobs, entropy) in variants.items():
        step_peak, outputs[name] = peak_bytes(lambda lp=logprobs: train_step(stage, data, lp))
        entropy_peak, outputs[f"{name}_entropy"] = peak_bytes(lambda en=entropy: en(logits))
        step_s = _seconds(lambda lp=logprobs: train_step(stage, data, lp), repeats)
        entropy_s = _seconds(lambda en=entropy: en(logits), repeats)
        results[name] = {
            "step_peak_bytes": step_peak,
            "step_peak_bytes_per_token": step_peak / tokens,
            "step_seconds_median": statistics.median(step_s),
            "step_seconds": step_s,
            "entropy_peak_bytes": entropy_peak,
            "entropy_peak_bytes_per_token": entropy_peak / tokens,
            "entropy_seconds_median": statistics.median(entropy_s),
        }
    _check_agree(outputs["formula"], outputs["chunked"])
    torch.testing.assert_close(outputs["chunked_entropy"], outputs["formula_entropy"], rtol=1e-6, atol=1e-6)
    before, after = results["formula"], results["chunked"]
    return {
        "device": "cpu",
        "model_dtype": dtype,
        "measured_with": "torch.profiler profile_memory=True: peak running sum of allocator events",
        "vocab": vocab,
        "tokens": tokens,
        "fp32_logits_bytes_per_token": 4 * vocab,
        "variants": results,
        "step_peak_reduction": 1 - after["step_peak_bytes"] / before["step_peak_bytes"],
        "entropy_peak_reduction": 1 - after["entropy_peak_bytes"] / before["entropy_peak_bytes"],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1025)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="model.dtype")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = run(args.vocab, args.batch, args.seq, args.repeats, args.dtype)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
