"""Packed passes against padded ones on one batch of GSM8K-length sequences.

The batch: ``--rows`` rows whose prompt and response lengths are GSM8K's, drawn (seeded) from
``data/text/gsm8k_test_first500.jsonl`` (question -> prompt, worked answer -> response), at about
4 characters per token (the shared data README's rule); token ids are random. Prompts are
left-padded and responses right-padded to the longest, as the engine's padded layout.

In one run, on a pool of ``--slots`` device slots (one data-parallel replica each), a tiny but not
trivial Llama: the median seconds of the forward pass (log-probs, ``forward_outputs``) and of the
train step (``train_step``, ``lm_loss`` over the responses) padded, then packed (``pack``, and
optionally ``--max-tokens`` per micro-batch); tokens/s counts real tokens. Before timing, the
packed log-probs are checked against the padded ones on every real target.

Peak memory is measured in this process, on one replica's rows as one micro-batch through a
single ``LlamaStage`` (forward, ``lm_loss``, backward), with ``torch.profiler`` allocation events as
``bench_logprob_memory.peak_bytes``: the most bytes held at once beyond the weights and inputs.

``physical_limit`` is real tokens / padded tokens: the share of the padded work that is real, so
``1 / physical_limit`` bounds the speed-up where cost is linear in tokens.

    python -m benchmarks.bench_packing [--rows 32] [--slots 2] [--repeats 3] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_logprob_memory import peak_bytes
from nereus_core.config import ModelConfig
from nereus_core.config.passes import PassesConfig
from nereus_core.engine import packing
from nereus_core.engine.forward import padding
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.engine.train import lm_loss
from nereus_core.layout import Layout
from nereus_core.model import LlamaStage, init_full_state
from nereus_core.model.tensor_parallel import vocab_parallel_logprobs
from tasks import model_ops
from tasks.runtime.device_pool import DevicePool

DATA = Path(__file__).resolve().parents[1] / "data" / "text" / "gsm8k_test_first500.jsonl"
MODEL = ModelConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    seed=1,
)
CHARS_PER_TOKEN = 4


def gsm8k_batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Padded ids, attention mask, response targets and the mini-batch's tokens per row."""
    records = [json.loads(line) for line in DATA.read_text().splitlines()]
    picked = random.Random(seed).sample(records, rows)
    prompts = [math.ceil(len(r["question"]) / CHARS_PER_TOKEN) for r in picked]
    responses = [math.ceil(len(r["answer"]) / CHARS_PER_TOKEN) for r in picked]
    p_max, r_max = max(prompts), max(responses)
    cols_p, cols_r = torch.arange(p_max), torch.arange(r_max)
    prompt_real = cols_p[None] >= (p_max - torch.tensor(prompts))[:, None]
    response_real = cols_r[None] < torch.tensor(responses)[:, None]
    mask = torch.cat([prompt_real, response_real], dim=1).long()
    ids = torch.randint(1, MODEL.vocab_size, mask.shape, generator=torch.Generator().manual_seed(seed))
    targets = torch.cat([torch.zeros_like(prompt_real), response_real], dim=1).long()
    per_row = torch.full((rows,), float(targets.sum()) / rows)
    return {
        "ids": ids.masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "mask": targets,
        "tokens_per_row": per_row,
    }


def _median_s(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _step_peak(stage: LlamaStage, batch: dict[str, torch.Tensor], pack: bool) -> int:
    """Peak bytes of one forward+backward of ``batch`` as one micro-batch, padded or packed."""

    def step() -> None:
        stage.zero_grad(set_to_none=True)
        ids = batch["ids"]
        if pack:
            (packed,) = packing.micro_batches(ids, batch["attention_mask"], micro_batches=1)
            logits = stage(packed.ids, packed.positions, segments=packed.cu_seqlens)
            logp = packing.unpack_targets(
                packed, vocab_parallel_logprobs(logits[:, :-1], packed.ids[:, 1:], None)
            )
        else:
            positions, mask = padding(batch["attention_mask"], ids.shape[1], ids.device)
            logits = stage(ids, positions, attention_mask=mask)
            logp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], None)
        del logits
        lm_loss(logp, batch).backward()

    return peak_bytes(step)[0]


def _timings(
    args: argparse.Namespace, batch: dict[str, torch.Tensor], modes: dict[str, PassesConfig]
) -> dict:
    """Median seconds and real tokens/s of the forward pass and the train step, per mode, after
    checking the packed log-probs against the padded ones."""
    mask = batch["attention_mask"]
    layout = Layout.contiguous(tp=1, pp=1, dp=args.slots, micro_batches=args.micro_batches)
    out: dict[str, Any] = {
        "forward_s": {},
        "train_s": {},
        "forward_tokens_per_s": {},
        "train_tokens_per_s": {},
    }
    with DevicePool(args.slots) as pool:
        model_ops.load_model(pool, layout, name="actor/infer", config=MODEL)
        opt = OptimizerSettings(lr=1e-5)
        model_ops.load_model(pool, layout, name="actor/train", config=MODEL, optimizer=opt)

        def forward(passes: PassesConfig) -> torch.Tensor:
            return model_ops.forward(
                pool, layout, batch["ids"], name="actor/infer", attention_mask=mask, passes=passes
            )

        both = (mask[:, 1:] * mask[:, :-1]).bool()
        out["packed_log_prob_gap"] = (
            (forward(modes["packed"]) - forward(modes["padded"]))[both].abs().max().item()
        )
        if out["packed_log_prob_gap"] > 1e-4:
            raise AssertionError(
                f"packed log-probs are {out['packed_log_prob_gap']:.2e} from the padded ones"
            )
        for m, p in modes.items():
            out["forward_s"][m] = _median_s(lambda p=p: forward(p), args.repeats)
            out["train_s"][m] = _median_s(
                lambda p=p: model_ops.train(pool, layout, batch, name="actor/train", passes=p), args.repeats
            )
            for phase in ("forward", "train"):
                out[f"{phase}_tokens_per_s"][m] = int(mask.sum()) / out[f"{phase}_s"][m]
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    batch = gsm8k_batch(args.rows, args.seed)
    mask = batch["attention_mask"]
    modes = {
        "padded": model_ops.PADDED,
        "packed": PassesConfig(pack=True, max_tokens_per_device=args.max_tokens),
    }
    result = _timings(args, batch, modes)
    stage = LlamaStage(MODEL, layers=range(MODEL.num_hidden_layers), first=True, last=True)
    stage.load_full_state(init_full_state(MODEL))
    replica = {k: v[: args.rows // args.slots] for k, v in batch.items()}
    result["peak_bytes_one_replica_step"] = {m: _step_peak(stage, replica, m == "packed") for m in modes}
    return {
        "data": str(DATA.relative_to(DATA.parents[2])),
        "rows": args.rows,
        "slots": args.slots,
        "micro_batches": args.micro_batches,
        "max_tokens": args.max_tokens,
        "model": MODEL.model_dump(
            include={"hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"}
        ),
        "width": int(mask.shape[1]),
        "real_tokens": int(mask.sum()),
        "padded_tokens": int(mask.numel()),
        "physical_limit": int(mask.sum()) / mask.numel(),
        **result,
        "speedup": {k: result[k]["padded"] / result[k]["packed"] for k in ("forward_s", "train_s")},
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    text = json.dumps(measure(args), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
