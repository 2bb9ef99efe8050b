"""The world model and the cost model's prior against real per-stage timings (JSON out).

Data: verl's GSM8K PPO console logs as parsed into per-step CSVs (shared data,
``rl_length/verl_gsm8k_ppo_*.csv``: ``timing/gen``, ``timing/ref``, ``timing/values``,
``timing/update_critic``, ``timing/update_actor``, response and prompt lengths per step).

- ``world``: ``nereus_core/sim/stage_world.py`` with its free constants fitted to the two
  Qwen2.5-0.5B runs (1 GPU, batch 256) and checked on the gemma-2-2b run (2 GPUs, rollout
  TP=2, batch 512), which the fit never sees. (A fit on one Qwen run alone cannot tell a
  fixed cost from a per-unit one: within a run every pass has the same padded shape and
  every generation the same longest response, so no single-run split is reported.)
- ``prior``: ``stage_cost.estimate`` with no calibration (scales 1) on an A100-80GB
  profile (the logs do not name their GPU; A100 assumed) with the fixed costs that
  ``hardware.H100_SXM`` carries; ``prior_fixed_costs_fit`` is the fit they come from.

What the runs compute, from each log's printed config (eric-haibin-lin/verl-data):
micro-batches of 2-4 sequences per GPU, every sequence padded to max prompt + max
response for the actor and critic passes, vLLM in eager mode with its cache freed
after each generation, and the actor's old log-probs recomputed inside ``timing/gen``.

Per run and stage: the median over steps of predicted / actual, and the medians of both.
``held_out_published``: both on NeMo RL's published 8B GRPO step on 16 H100s (fitted to
neither; the assumptions it needs are printed with it).

    python -m benchmarks.validate_cost_model --data PATH/TO/rl_length [--every 5]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nereus_core.config import ModelConfig, Workload
from nereus_core.cost.hardware import H100_SXM, HardwareProfile
from nereus_core.cost.stage_cost import estimate
from nereus_core.layout import Layout
from nereus_core.plan import models_for
from nereus_core.sim import stage_world

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
    "qwen": stage_world.ModelSize(
        params=494e6, layers=24, kv_bytes_per_token=2 * 24 * 2 * 64 * 2, hidden=896
    ),
    "gemma": stage_world.ModelSize(
        params=2.61e9, layers=26, kv_bytes_per_token=2 * 26 * 4 * 256 * 2, hidden=2304
    ),
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


@dataclass(frozen=True)
class Run:
    """One logged verl run, as its console log's config prints it (eric-haibin-lin/verl-data)."""

    model: str
    config: ModelConfig
    gpus: int
    rollout_tp: int
    batch: int
    max_prompt: int  # data.max_prompt_length: prompts are left-padded to it
    max_response: int  # data.max_response_length: responses are padded to it
    train_micro: int  # actor/critic ppo_micro_batch_size (per GPU; critic values use it too)
    log_prob_micro: int  # rollout/ref log_prob_micro_batch_size (per GPU)


RUNS = {
    "Qwen2.5-0.5B-bsz256_2-prompt512-resp256-0.538": Run("qwen", QWEN_05B, 1, 1, 256, 512, 256, 2, 4),
    "Qwen2.5-0.5B-bsz256_2-prompt1024-resp512-0.567": Run("qwen", QWEN_05B, 1, 1, 256, 1024, 512, 2, 4),
    "gemma-2-2b-it-ppo-bsz512_4-prompt1024-resp-512-0.640": Run(
        "gemma", GEMMA2_2B, 2, 2, 512, 1024, 512, 4, 4
    ),
}
QWEN = list(RUNS)[:2]


def load(data: Path, run: str, every: int) -> list[dict[str, float]]:
    with (data / f"verl_gsm8k_ppo_{run}.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if all(r.get(k) for k in STAGES)]
    return [{k: float(v) for k, v in r.items() if v} for r in rows[::every]]


def stats(run: str, row: dict[str, float]) -> stage_world.StepStats:
    return stage_world.StepStats(
        batch=RUNS[run].batch,
        prompt_mean=row["prompt_length/mean"],
        response_mean=max(row["response_length/mean"], 1.0),
        response_max=int(row["response_length/max"]),
        response_min=int(row["response_length/min"]),
    )


def padded(run: str) -> stage_world.StepStats:
    """What verl 0.1's actor and critic passes compute on: every sequence left-padded to
    max_prompt_length and its response padded to max_response_length (no padding removal yet)."""
    r = RUNS[run]
    return stage_world.StepStats(r.batch, r.max_prompt, r.max_response, r.max_response, r.max_response)


# --------------------------------------------------------------------------- the world


def world_s(run: str, row: dict[str, float], col: str, c: stage_world.WorldConstants, seed: int) -> float:
    """The world's seconds of one logged stage. verl 0.1's ``generate_sequences`` recomputes the
    actor's old log-probs right after generation, inside ``timing/gen`` (its logs have no separate
    ``timing/old_log_prob``), so the world's ``timing/gen`` is generation plus one actor forward."""
    r, kind = RUNS[run], STAGES[col][0]
    size, pad = SIZES[r.model], padded(run)
    if kind != "generate":
        return stage_world.stage_s(kind, pad, size, stage_world.A100_80GB, c, tp=1, dp=r.gpus, seed=seed)
    t = r.rollout_tp
    out = stage_world.stage_s(
        kind, stats(run, row), size, stage_world.A100_80GB, c, tp=t, dp=r.gpus // t, seed=seed
    )
    return out + stage_world.stage_s("infer", pad, size, stage_world.A100_80GB, c, tp=1, dp=r.gpus, seed=seed)


def fit_world(rows: dict[str, list[dict[str, float]]], fit_on: list[str]) -> stage_world.WorldConstants:
    """``stage_world.fit`` on the fitted runs: the passes first, then generation on ``timing/gen``
    less the old-log-prob forward the fitted passes predict."""
    passes, gens = [], []
    for run in fit_on:
        r = RUNS[run]
        for row in rows[run]:
            for col, (kind, _) in STAGES.items():
                if kind != "generate":
                    passes.append(
                        (kind, padded(run), SIZES[r.model], stage_world.A100_80GB, 1, r.gpus, row[col])
                    )
    c = stage_world.fit(passes, stage_world.WorldConstants())
    for run in fit_on:
        r = RUNS[run]
        for i, row in enumerate(rows[run]):
            s = stats(run, row)
            fwd = stage_world.stage_s(
                "infer", padded(run), SIZES[r.model], stage_world.A100_80GB, c, tp=1, dp=r.gpus, seed=i
            )
            t = r.rollout_tp
            gens.append(
                (
                    "generate",
                    s,
                    SIZES[r.model],
                    stage_world.A100_80GB,
                    t,
                    r.gpus // t,
                    row["timing/gen"] - fwd,
                )
            )
    return stage_world.fit(gens, c)


# --------------------------------------------------------------------------- the cost model's prior


def workloads(run: str, row: dict[str, float]) -> tuple[Workload, Workload]:
    """Generation's workload (the logged lengths) and the passes' (verl 0.1 pads every sequence to
    max_prompt + max_response: its actor and critic run padded batches, no padding removal)."""
    r, s = RUNS[run], stats(run, row)
    gen = Workload(
        batch=r.batch,
        prompt_len=max(round(s.prompt_mean), 1),
        response_mean=s.response_mean,
        response_high=max(s.response_max, round(s.response_mean)),
        response_max=max(s.response_max, round(s.response_mean)),
    )
    padded = Workload(
        batch=r.batch,
        prompt_len=r.max_prompt,
        response_mean=r.max_response,
        response_high=r.max_response,
        mini_batches=r.batch // {"qwen": 64, "gemma": 128}[r.model],  # ppo_mini_batch_size
    )
    return gen, padded


def prior_s(run: str, row: dict[str, float], col: str, profile: HardwareProfile) -> float:
    """``stage_cost.estimate`` (no calibration) of one logged stage; ``timing/gen`` adds the actor's
    old-log-prob forward (see ``world_s``). Micro-batches per GPU follow the logged config."""
    r, stage = RUNS[run], STAGES[col][1]
    gen, padded = workloads(run, row)
    per_gpu = r.batch // r.gpus
    models = models_for(r.config)
    if stage == "actor/generate":
        layout = Layout.contiguous(tp=r.rollout_tp, dp=r.gpus // r.rollout_tp)
        fwd = Layout.contiguous(dp=r.gpus, micro_batches=per_gpu // r.log_prob_micro)
        return (
            estimate(stage, layout, gen, models["actor"], profile).seconds
            + estimate("actor/infer", fwd, padded, models["actor"], profile).seconds
        )
    micro = r.log_prob_micro if stage == "reference/infer" else r.train_micro
    layout = Layout.contiguous(dp=r.gpus, micro_batches=per_gpu // micro)
    return estimate(stage, layout, padded, models[stage.split("/")[0]], profile).seconds


FIXED = ("generate_call_s", "decode_step_s", "infer_call_s", "train_call_s")


def fit_prior(rows: dict[str, list[dict[str, float]]], fit_on: list[str]) -> dict[str, float]:
    """The prior's fixed costs by least squares on the fitted runs: each logged pass less the prior
    with no fixed costs is a constant per call (infer, train); then ``timing/gen`` less the prior
    (its old-log-prob forward with the fitted infer cost) is one constant per generation call plus
    one per decode iteration of the slowest replica (``response_max`` here: one wave)."""
    bare = A100.model_copy(update=dict.fromkeys(FIXED, 0.0))
    out: dict[str, float] = {}
    for kind in ("infer", "train"):
        cols = [col for col, (k, _) in STAGES.items() if k == kind]
        res = [row[c] - prior_s(run, row, c, bare) for run in fit_on for row in rows[run] for c in cols]
        out[f"{kind}_call_s"] = max(float(np.mean(res)), 0.0)
    with_infer = bare.model_copy(update={"infer_call_s": out["infer_call_s"]})
    x = [[1.0, row["response_length/max"]] for run in fit_on for row in rows[run]]
    y = [
        row["timing/gen"] - prior_s(run, row, "timing/gen", with_infer) for run in fit_on for row in rows[run]
    ]
    (fixed, step), *_ = np.linalg.lstsq(np.array(x), np.array(y), rcond=None)
    out |= {"generate_call_s": max(float(fixed), 0.0), "decode_step_s": max(float(step), 0.0)}
    return {k: round(v, 5) for k, v in out.items()}


# --------------------------------------------------------------------------- the report


def report(
    run: str, rows: list[dict[str, float]], c: stage_world.WorldConstants, split: str
) -> dict[str, object]:
    stages = {}
    for col in STAGES:
        actual = [r[col] for r in rows]
        world = [world_s(run, r, col, c, i) for i, r in enumerate(rows)]
        prior = [prior_s(run, r, col, A100) for r in rows]
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
    fitted = fit_world(rows, fit_on)
    runs = [report(run, rows[run], fitted, "fitted" if run in fit_on else "held_out") for run in RUNS]
    held = [s for r in runs if r["split"] == "held_out" for s in r["stages"].values()]
    world = [s["world_over_actual"] for s in held]
    prior = [s["prior_over_actual"] for s in held]
    return {
        "fitted_on": fit_on,
        "constants": {k: round(v, 6) for k, v in vars(fitted).items()},
        "prior_fixed_costs_fit": fit_prior(rows, fit_on),
        "prior_fixed_costs_used": {k: getattr(A100, k) for k in FIXED},
        "held_out_world_ratio_range": [min(world), max(world)] if world else None,
        "held_out_world_within_0.5_2x": all(0.5 <= h <= 2.0 for h in world),
        "held_out_prior_ratio_range": [min(prior), max(prior)] if prior else None,
        "held_out_prior_within_0.5_2x": all(0.5 <= h <= 2.0 for h in prior),
        "runs": runs,
    }


# NVIDIA-NeMo/RL docs/about/performance-summary.md (v0.4, DGX-H100, BF16, Megatron-core): GRPO
# Llama-3.1-8B on policy, 16 GPUs, 2,048 sequences per step (G-GBS; 4 optimizer steps of 512),
# generation TP1, max sequence 4,096, average 1,060 tokens: 97.7 s per step (generation, log-probs,
# training and refit).
# Not stated there, so assumed: 150 prompt tokens, a p90 response of twice the mean, the longest
# response at the cap; GRPO's stages: generation, the policy's and the reference's log-probs, train.
NEMO_RL = {"step_s": 97.7, "gpus": 16, "batch": 2048, "mean_sequence": 1060}
PROMPT_ASSUMED = 150


def nemo_rl_check() -> dict[str, object]:
    """The prior and the world on NeMo RL's published 8B GRPO step (held out: fitted to neither)."""
    from nereus_core.config import LLAMA_3_8B
    from nereus_core.sim.shapes import model_size

    n, prompt = NEMO_RL["gpus"], PROMPT_ASSUMED
    mean = float(NEMO_RL["mean_sequence"] - prompt)
    work = Workload(
        batch=NEMO_RL["batch"],
        prompt_len=prompt,
        response_mean=mean,
        response_high=round(2 * mean),
        response_max=4096 - prompt,
        mini_batches=4,
    )
    models = models_for(LLAMA_3_8B)
    gen, passes = Layout.contiguous(dp=n), Layout.contiguous(dp=n, micro_batches=32)
    stages = {"actor/generate": gen, "actor/infer": passes, "reference/infer": passes, "actor/train": passes}
    prior = {s: estimate(s, v, work, models[s.split("/")[0]], H100_SXM).seconds for s, v in stages.items()}
    step = stage_world.StepStats(work.batch, prompt, mean, work.response_max, 1, work.response_high)
    size, c = model_size(LLAMA_3_8B), stage_world.FITTED
    world = {
        s: stage_world.stage_s(s.split("/")[1], step, size, stage_world.H100_80GB, c, tp=1, dp=n, seed=0)
        for s in stages
    }
    out: dict[str, object] = {"published": NEMO_RL, "assumed": "150 prompt tokens; p90 2x mean; max at cap"}
    for name, per in (("prior", prior), ("world", world)):
        total = sum(per.values())
        out[name] = {
            "stages_s": {k: round(v, 2) for k, v in per.items()},
            "step_s": round(total, 2),
            "step_over_published": round(total / NEMO_RL["step_s"], 3),
            "generation_share": round(per["actor/generate"] / total, 3),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, required=True, help="the folder of verl's per-stage PPO logs (rl_length/)"
    )
    parser.add_argument("--every", type=int, default=5, help="Use every n-th logged step.")
    args = parser.parse_args()
    out = {
        "benchmark": "validate_cost_model",
        "gpu_assumed": stage_world.A100_80GB.name,
        "experiments": [experiment(args.data, QWEN, args.every)],
        "held_out_published": {"nemo_rl_grpo_llama3.1_8b_16xh100": nemo_rl_check()},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
