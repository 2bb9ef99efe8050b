"""The memory model against the runtime's measured peaks: one train or forward stage per layout choice,
on a 2-process gloo world of CPU devices (JSON out).

For each case (a model-stage, its layout's degrees and micro-batches, ZeRO stage, gradient
checkpointing, packing) every rank loads the stage as a job does (``engine.shard.load_shard``), runs
one warm-up step, then one measured step: the bytes its model state holds before the step
(``engine.memory.held_bytes``: weights, gradients kept, optimizer state) plus the most bytes the step
allocated at once beyond that (``torch.profiler`` allocation events, ``bench_logprob_memory.peak_bytes``:
activations, gradients, logits, the collectives' buffers, every temporary). The busiest rank's sum is
the measured peak; the cost model's is ``cost.stage_cost.estimate(...).memory.total`` on the CPU
profile for the same stage, layout, workload and model. ``ratio`` is predicted over measured.

The physical floor of a train step is its model state (weights, gradients, optimizer state), which
the activations add to; of a forward, its weights and the logits of one micro-batch.

    python -m benchmarks.bench_stage_memory [--hidden 256] [--layers 4] [--vocab 4096] [--rows 8]
        [--seq 256] [--cases NAME ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from benchmarks import bench_recompute
from benchmarks.bench_logprob_memory import peak_bytes
from nereus_core.config import ModelConfig, Workload
from nereus_core.cost.hardware import get_profile
from nereus_core.cost.stage_cost import estimate
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.dispatch import per_device_batch
from nereus_core.engine.forward import forward_outputs
from nereus_core.engine.memory import held_bytes
from nereus_core.engine.optimizer import OptimizerSettings
from nereus_core.engine.shard import drop_all, load_shard
from nereus_core.engine.train import lm_loss, train_step
from nereus_core.layout import Layout
from tests.support.dist_utils import run_world

WORLD = 2  # ranks; a case's layout uses some or all of them


class Case(BaseModel):
    """One stage on one layout: what the memory model must predict."""

    model_config = ConfigDict(frozen=True)

    name: str
    stage: str  # "actor/train" or "reference/infer"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batches: int = 1
    zero_stage: int = 1
    recompute: bool = False  # the model's launch flag (model.gradient_checkpointing)
    layout_recompute: bool = False  # the layout's choice (Layout.recompute)
    pack: bool = False
    max_tokens: int | None = None  # a packed micro-batch's token budget (verl's ppo_max_token_len_per_gpu)
    dtype: str = "fp32"  # bf16: bf16 weights and activations, fp32 masters and moments
    head: str = "lm"  # value: a critic
    schedule: str = "gpipe"  # a pipeline's (Layout.schedule)
    shard: str = "optimizer"  # full: ZeRO-3 over dp (Layout.shard)

    @property
    def train(self) -> bool:
        return self.stage.endswith("/train")

    def layout(self) -> Layout:
        layout = Layout.contiguous(tp=self.tp, pp=self.pp, dp=self.dp, micro_batches=self.micro_batches)
        choices = {"schedule": self.schedule, "recompute": self.layout_recompute, "shard": self.shard}
        return layout.model_copy(update=choices)


CASES = (
    Case(name="train", stage="actor/train"),
    Case(name="train-2mb", stage="actor/train", micro_batches=2),
    Case(name="train-recompute", stage="actor/train", recompute=True),
    Case(
        name="train-pp2-1f1b-recompute",
        stage="actor/train",
        pp=2,
        micro_batches=4,
        schedule="1f1b",
        layout_recompute=True,
    ),
    Case(name="train-packed", stage="actor/train", pack=True),
    Case(name="train-tp2", stage="actor/train", tp=2),
    Case(name="train-packed-budget", stage="actor/train", pack=True, max_tokens=512),
    Case(name="train-pp2-gpipe", stage="actor/train", pp=2, micro_batches=2),
    Case(name="train-pp2-gpipe-4mb", stage="actor/train", pp=2, micro_batches=4),
    Case(name="train-pp2-1f1b-4mb", stage="actor/train", pp=2, micro_batches=4, schedule="1f1b"),
    Case(name="train-dp2-zero1", stage="actor/train", dp=2),
    Case(name="train-dp2-zero2", stage="actor/train", dp=2, zero_stage=2),
    Case(name="train-dp2-full", stage="actor/train", dp=2, shard="full"),
    Case(name="train-dp2-full-2mb", stage="actor/train", dp=2, micro_batches=2, shard="full"),
    Case(name="train-dp2-full-bf16", stage="actor/train", dp=2, shard="full", dtype="bf16"),
    Case(name="train-bf16", stage="actor/train", dtype="bf16"),
    Case(name="critic-train", stage="critic/train", head="value"),
    Case(name="forward", stage="reference/infer"),
    Case(name="forward-packed", stage="reference/infer", pack=True),
    Case(name="forward-bf16", stage="reference/infer", dtype="bf16"),
    Case(name="forward-tp2", stage="reference/infer", tp=2),
    Case(name="forward-pp2", stage="reference/infer", pp=2, micro_batches=2),
)


def model(args: argparse.Namespace, case: Case) -> ModelConfig:
    """``bench_recompute``'s decoder of the arguments' sizes, in the case's dtype and head."""
    return bench_recompute.model(args, case.recompute).model_copy(
        update={"dtype": case.dtype, "head": case.head}
    )


def batch(args: argparse.Namespace, case: Case) -> dict[str, torch.Tensor]:
    """``rows`` rows of ``seq`` token slots; packed cases' rows are real for a quarter to all of
    their slots (right-padded), padded cases' rows are whole."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.rows, args.seq), generator=gen)
    if not case.pack:
        return {"ids": ids}
    lengths = torch.linspace(args.seq // 4, args.seq, args.rows).long()
    mask = (torch.arange(args.seq)[None, :] < lengths[:, None]).long()
    return {"ids": ids, "attention_mask": mask}


def workload(args: argparse.Namespace, case: Case) -> Workload:
    """The batch as the cost model sees it: ``rows`` sequences of the real mean length and ``seq`` high."""
    rows = batch(args, case)
    real = float(rows["attention_mask"].sum(1).float().mean()) if case.pack else float(args.seq)
    return Workload(
        batch=args.rows,
        prompt_len=1,
        response_mean=real - 1,
        response_high=args.seq - 1,
        pack=case.pack,
        max_tokens_per_device=case.max_tokens,
    )


def value_loss(values_bs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A critic's stand-in loss: every value towards zero."""
    return values_bs.float().pow(2).mean()


def _measure_case(ctx: DeviceContext, args: argparse.Namespace, case: Case) -> dict[str, int] | None:
    layout = case.layout()
    ctx.build_groups(layout)  # collective: every rank, member or not
    if ctx.rank not in layout.devices:
        return None
    settings = OptimizerSettings(zero_stage=case.zero_stage) if case.train else None
    load_shard(ctx, name="stage", layout=layout, config=model(args, case), optimizer=settings)
    part = per_device_batch(layout, batch(args, case))[layout.devices.index(ctx.rank)]
    passes = {"pack": case.pack, "max_tokens": case.max_tokens}

    def step() -> Any:
        if case.train:
            loss = value_loss if case.head == "value" else lm_loss
            return train_step(ctx, part, name="stage", loss_fn=loss, **passes)
        return forward_outputs(ctx, part["ids"], part.get("attention_mask"), name="stage", **passes)

    step()  # warm-up: the optimizer's state and DeepSpeed's buffers exist from the first step on
    held = held_bytes(ctx)
    transient, _ = peak_bytes(step)
    drop_all(ctx)
    return {"held_bytes": held, "step_peak_bytes": transient, "peak_bytes": held + transient}


def _measure_rank(
    rank: int, world: int, args: argparse.Namespace, cases: list[Case]
) -> list[dict[str, int] | None]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # DeepSpeed reads them; the world exists
    ctx = DeviceContext(rank=rank, world_size=world, backend="gloo", device=torch.device("cpu"))
    return [_measure_case(ctx, args, case) for case in cases]


def measure(args: argparse.Namespace, cases: list[Case]) -> list[dict[str, Any]]:
    """Each case measured on one world of ``WORLD`` ranks, beside the cost model's prediction."""
    per_rank = run_world(WORLD, _measure_rank, args, cases, timeout_s=600)
    out = []
    for i, case in enumerate(cases):
        busiest = max((r[i] for r in per_rank if r[i] is not None), key=lambda r: r["peak_bytes"])
        profile = get_profile("cpu")
        mem = estimate(case.stage, case.layout(), workload(args, case), model(args, case), profile).memory
        out.append(
            {
                "case": case.model_dump(),
                "measured": busiest,
                "predicted": {**mem.model_dump(), "total": mem.total},
                "ratio": mem.total / busiest["peak_bytes"],
            }
        )
    return out


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--cases", nargs="*", default=[c.name for c in CASES])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    unknown = set(args.cases) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from {[c.name for c in CASES]}")
    return args


def main() -> None:
    args = arguments()
    results = measure(args, [c for c in CASES if c.name in args.cases])
    ratios = [r["ratio"] for r in results]
    out = {
        "benchmark": "bench_stage_memory",
        "machine": platform.machine(),
        **{k: v for k, v in vars(args).items() if k not in ("cases", "out")},
        "cases": results,
        "worst_ratio": max(ratios, key=lambda x: abs(x - 1.0)),
    }
    text = json.dumps(out, indent=2, default=str)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
