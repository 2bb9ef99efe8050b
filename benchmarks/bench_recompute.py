"""Gradient checkpointing (``model.gradient_checkpointing``) against keeping every activation, one train
step side by side on one CPU device.

A Llama decoder (``--layers`` layers of width ``--hidden``) trains on ``--rows`` rows of ``--seq``
tokens (random ids, the loss over every token): forward, the engine's log-probs, ``lm_loss``,
backward, through one ``LlamaStage`` (``bench_logprob_memory.train_step``). Each variant's peak
memory is the most bytes allocated at once while the step runs (``torch.profiler`` allocation
events: ``bench_logprob_memory.peak_bytes``), its time the median of ``--repeats`` steps
(``bench_runtime.median_s``). The gradients of the two are compared bit for bit.

Beside the measurement, the cost model's prediction of what the flag frees (the pass's activations,
``cost.stage_cost.estimate`` on the CPU profile, one micro-batch) and the time it adds: the measured
peak difference against the predicted activation difference (``saved_ratio``). The physical limit:
recomputation can free at most the activations of all layers but the one being recomputed; its
time is one more forward of every layer (``one_more_forward``: the step's time plus a no-grad
forward's, over the step's), to which autograd's bookkeeping of the recomputed forward adds.

    python -m benchmarks.bench_recompute [--layers 8] [--hidden 256] [--rows 8] [--seq 512]
"""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any

import torch

from benchmarks.bench_logprob_memory import chunked_logprobs, peak_bytes, train_step
from benchmarks.bench_runtime import median_s
from nereus_core.config import ModelConfig, Workload
from nereus_core.cost.hardware import get_profile
from nereus_core.cost.stage_cost import estimate
from nereus_core.layout import Layout
from nereus_core.model.llama import LlamaStage
from nereus_core.model.weights import init_full_state


def model(args: argparse.Namespace, checkpointed: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq,
        gradient_checkpointing=checkpointed,
    )


def forward_only(stage: LlamaStage, ids: torch.Tensor) -> None:
    with torch.no_grad():
        stage(ids, torch.arange(ids.shape[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.rows, args.seq))
    profile = get_profile("cpu")
    work = Workload(batch=args.rows, prompt_len=1, response_mean=args.seq - 1, response_high=args.seq - 1)
    layout = Layout(tp=1, pp=1, dp=1, devices=(0,), micro_batches=1)
    out: dict[str, Any] = {"benchmark": "bench_recompute", "machine": platform.machine(), **vars(args)}
    grads = {}
    for name, flag in (("plain", False), ("checkpointed", True)):
        config = model(args, flag)
        stage = LlamaStage(config, layers=range(args.layers), first=True, last=True)
        stage.load_full_state(init_full_state(config))

        def step(s: LlamaStage = stage) -> dict[str, Any]:
            return train_step(s, {"ids": ids}, chunked_logprobs)  # the engine's log-probs, lm_loss

        step()  # warm-up
        peak, result = peak_bytes(step)
        grads[name] = result["grads"]
        predicted = estimate("actor/train", layout, work, config, profile)
        out[name] = {
            "peak_bytes": peak,
            "step_s": median_s(step, args.repeats),
            "forward_s": median_s(lambda s=stage: forward_only(s, ids), args.repeats),
            "predicted_activation_bytes": int(predicted.memory.activations),
            "predicted_step_s": predicted.seconds,
        }
    plain, again = out["plain"], out["checkpointed"]
    out["grads_bitwise_equal"] = all(
        torch.equal(grads["plain"][k], grads["checkpointed"][k]) for k in grads["plain"]
    )
    out["measured_saved_bytes"] = plain["peak_bytes"] - again["peak_bytes"]
    out["predicted_saved_bytes"] = plain["predicted_activation_bytes"] - again["predicted_activation_bytes"]
    out["saved_ratio"] = out["measured_saved_bytes"] / out["predicted_saved_bytes"]
    out["step_time_ratio"] = again["step_s"] / plain["step_s"]
    out["predicted_step_time_ratio"] = again["predicted_step_s"] / plain["predicted_step_s"]
    out["one_more_forward"] = 1.0 + plain["forward_s"] / plain["step_s"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
