"""The world model and the cost model's prior against real per-stage timings (JSON out).

Data: verl's GSM8K PPO console logs as parsed into per-step CSVs (shared data,
``rl_length/verl_gsm8k_ppo_*.csv``: ``timing/gen``, ``timing/ref``, ``timing/values``,
``timing/update_critic``, ``timing/update_actor``, response and prompt lengths per step).

- ``world``: ``nereus_core/sim/stage_world.py`` with its free constants fitted to the two
  Qwen2.5-0.5B runs (1 GPU, batch 256) and checked on the gemma-2-2b run (2 GPUs, rollout
  TP=2, batch 512), which the fit never sees; a second split fits on the 256-token Qwen run
  alone and holds out the 512-token one.
- ``cost_model_prior``: ``cost_model.estimate`` with no calibration (scales 1) on an A100-80GB
  profile (the logs do not name their GPU; A100 assumed).

Per run and stage: the median over steps of predicted / actual, and the medians of both.

    python benchmarks/validate_cost_model.py [--data ../shared/data/rl_length] [--every 5]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

from nereus_core.config import ModelConfig
from nereus_core.cost_model import Workload, estimate
from nereus_core.hardware import H100_SXM
from nereus_core.layout import Layout
from nereus_core.plan import models_for
from nereus_core.sim import stage_world as sw

QWEN_05B = ModelConfig(  # Qwen/Qwen2.5-0.5B-Instruct config.json
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
GEMMA2_2B = ModelConfig(  # google/gemma-2-2b-it config.json; head_dim 288 here (256 there: no field for it)
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
# The world's view of the same models: parameters (config.json sizes) and bf16 KV bytes per token.
SIZES = {
    "qwen": sw.ModelSize(params=494e6, layers=24, kv_bytes_per_token=2 * 24 * 2 * 64 * 2, hidden=896),
    "gemma": sw.ModelSize(params=2.61e9, layers=26, kv_bytes_per_token=2 * 26 * 4 * 256 * 2, hidden=2304),
}
# NVIDIA A100 80GB SXM datasheet; NVLink 3: 600 GB/s both directions, 300 one way.
A100 = H100_SXM.model_copy(
    update={
        "name": "a100-80gb",
        "peak_flops": 312e12,
        "memory_bandwidth": 2.039e12,
        "intra_node_bandwidth": 300e9,
        "memory_per_device": 80 * 10**9,
    }
)
STAGES = {  # verl column -> (world kind, cost-model stage)
    "timing/gen": ("generate", "actor/generate"),
    "timing/ref": ("infer", "reference/infer"),
    "timing/values": ("infer", "critic/infer"),
    "timing/update_critic": ("train", "critic/train"),
    "timing/update_actor": ("train", "actor/train"),
}
RUNS = {  # file stem -> (model key, config, GPUs, rollout TP, batch, mini-batches)
    "Qwen2.5-0.5B-bsz256_2-prompt512-resp256-0.538": ("qwen", QWEN_05B, 1, 1, 256, 4),
    "Qwen2.5-0.5B-bsz256_2-prompt1024-resp512-0.567": ("qwen", QWEN_05B, 1, 1, 256, 4),
    "gemma-2-2b-it-ppo-bsz512_4-prompt1024-resp-512-0.640": ("gemma", GEMMA2_2B, 2, 2, 512, 4),
}
QWEN = list(RUNS)[:2]


def load(data: Path, run: str, every: int) -> list[dict[str, float]]:
    with (data / f"verl_gsm8k_ppo_{run}.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if all(r.get(k) for k in STAGES)]
    return [{k: float(v) for k, v in r.items() if v} for r in rows[::every]]


def stats(run: str, row: dict[str, float]) -> sw.StepStats:
    return sw.StepStats(
        batch=RUNS[run][4],
        prompt_mean=row["prompt_length/mean"],
        response_mean=max(row["response_length/mean"], 1.0),
        response_max=int(row["response_length/max"]),
        response_min=int(row["response_length/min"]),
    )


def world_rows(run: str, rows: list[dict[str, float]]) -> list[tuple]:
    key, _, gpus, tp, _, _ = RUNS[run]
    out = []
    for row in rows:
        for col, (kind, _) in STAGES.items():
            t, d = (tp, gpus // tp) if kind == "generate" else (1, gpus)
            out.append((kind, stats(run, row), SIZES[key], sw.A100_80GB, t, d, row[col]))
    return out


def prior_s(run: str, row: dict[str, float], stage: str) -> float:
    _, model, gpus, tp, batch, mini = RUNS[run]
    s = stats(run, row)
    work = Workload(
        batch=batch,
        prompt_len=max(round(s.prompt_mean), 1),
        response_mean=s.response_mean,
        response_high=max(s.response_max, round(s.response_mean)),
        mini_batches=mini,
    )
    layout = Layout.contiguous(tp=tp) if stage.endswith("generate") else Layout.contiguous(dp=gpus)
    return estimate(stage, layout, work, models_for(model)[stage.split("/")[0]], A100).seconds


def report(run: str, rows: list[dict[str, float]], c: sw.WorldConstants, split: str) -> dict[str, object]:
    key, _, gpus, tp, _, _ = RUNS[run]
    stages = {}
    for col, (kind, stage) in STAGES.items():
        actual = [r[col] for r in rows]
        t, d = (tp, gpus // tp) if kind == "generate" else (1, gpus)
        world = [
            sw.stage_s(kind, stats(run, r), SIZES[key], sw.A100_80GB, c, tp=t, dp=d, seed=i)
            for i, r in enumerate(rows)
        ]
        prior = [prior_s(run, r, stage) for r in rows]
        stages[col] = {
            "actual_median_s": round(statistics.median(actual), 3),
            "world_median_s": round(statistics.median(world), 3),
            "prior_median_s": round(statistics.median(prior), 3),
            "world_over_actual": round(
                statistics.median(w / a for w, a in zip(world, actual, strict=True)), 3
            ),
            "prior_over_actual": round(
                statistics.median(p / a for p, a in zip(prior, actual, strict=True)), 3
            ),
        }
    return {"run": run, "split": split, "steps": len(rows), "stages": stages}


def experiment(data: Path, fit_on: list[str], every: int) -> dict[str, object]:
    rows = {run: load(data, run, every) for run in RUNS}
    fitted = sw.fit([x for run in fit_on for x in world_rows(run, rows[run])], sw.WorldConstants())
    runs = [report(run, rows[run], fitted, "fitted" if run in fit_on else "held_out") for run in RUNS]
    held = [s["world_over_actual"] for r in runs if r["split"] == "held_out" for s in r["stages"].values()]
    return {
        "fitted_on": fit_on,
        "constants": {k: round(v, 6) for k, v in vars(fitted).items()},
        "held_out_world_ratio_range": [min(held), max(held)] if held else None,
        "held_out_within_0.5_2x": all(0.5 <= h <= 2.0 for h in held),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/rl_length"))
    parser.add_argument("--every", type=int, default=5, help="Use every n-th logged step.")
    args = parser.parse_args()
    out = {
        "benchmark": "validate_cost_model",
        "gpu_assumed": sw.A100_80GB.name,
        "experiments": [
            experiment(args.data, QWEN, args.every),
            experiment(args.data, QWEN[:1], args.every),
        ],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
