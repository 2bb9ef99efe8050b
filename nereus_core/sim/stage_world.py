"""A stage-time world model that is not the cost model: what a PPO stage takes on real GPUs.

Boundary: pure arithmetic over a model's size, a step's length statistics and a GPU
(``Gpu``), with a handful of free constants (``WorldConstants``) fitted to real logs
by ``fit`` (benchmarks/validate_cost_model.py fits them to verl's Qwen2.5-0.5B GSM8K
PPO logs and checks them on the held-out gemma-2-2b log). It shares no formula with
``cost_model``/``cost_terms``, so comparing the two can show the cost model wrong.
Not yet wired into ``world.World`` (the simulator's truth is still the scaled cost model).

Generation (issue 17): each sequence's response length is drawn from the step's
distribution (a Beta between the step's min and max with the step's mean, so the tail
reaches the logged max); each DP replica runs continuous batching under its KV budget
(a finished sequence frees its slot for a waiting one); every decode iteration costs a
fixed ``decode_step_s`` (scheduler, sampling, kernel launches) plus reading the
weights / tp and the active KV cache from HBM (hardware.md, "Decode is memory-bound");
the stage ends with the slowest replica, plus ``generate_fixed_s`` per step (engine
wake-up, weight load into the engine, tokenisation). Infer and train passes: a fixed
cost per call plus FLOPs (2 x params per token forward, 6 x train; hardware.md
"Training FLOPs") at ``mfu`` of the peak, plus the Adam step's memory traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Gpu:
    """One accelerator's peak figures."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float


# NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, 80 GB. The verl logs do not
# name their GPU; A100-80GB is assumed (verl's reference runs of that time were on A100s).
A100_80GB = Gpu("a100-80gb", 312e12, 2.039e12, 80e9)
# hardware.md "Hardware (H100 SXM)": 989.4 TFLOP/s bf16, 3.35 TB/s HBM3, 80 GB.
H100_80GB = Gpu("h100-sxm", 989.4e12, 3.35e12, 80e9)


@dataclass(frozen=True)
class ModelSize:
    """What the world needs of a model: parameters, layers and KV bytes per token (bf16)."""

    params: float
    layers: int
    kv_bytes_per_token: float


@dataclass(frozen=True)
class StepStats:
    """One PPO step as a log reports it: sequences, prompt and response lengths."""

    batch: int
    prompt_mean: float
    response_mean: float
    response_max: int
    response_min: int = 1


@dataclass(frozen=True)
class WorldConstants:
    """The free constants, fitted to real logs (see ``fit``); the defaults are priors before fitting."""

    generate_fixed_s: float = 1.0  # per generation call
    decode_step_s: float = 1e-3  # per decode iteration of a replica
    infer_fixed_s: float = 0.5  # per forward-only pass over the batch
    train_fixed_s: float = 1.0  # per train stage (all its micro-batches and optimizer steps)
    mfu: float = 0.4  # share of peak FLOP/s reached by infer/train passes
    hbm_efficiency: float = 0.8  # share of HBM bandwidth reached by decode
    kv_share: float = 0.9  # share of the free device memory the engine gives the KV cache
    length_concentration: float = 4.0  # Beta a + b of the response-length draw (spread of lengths)


def draw_lengths(stats: StepStats, rng: np.random.Generator, concentration: float) -> np.ndarray:
    """Response length of every sequence: min + (max - min) x Beta with the step's mean."""
    lo, hi = max(stats.response_min, 1), max(stats.response_max, 1)
    if hi <= lo:
        return np.full(stats.batch, hi, dtype=np.int64)
    share = float(np.clip((stats.response_mean - lo) / (hi - lo), 0.02, 0.98))
    x = rng.beta(share * concentration, (1 - share) * concentration, size=stats.batch)
    out = np.rint(lo + x * (hi - lo)).astype(np.int64)
    out[int(rng.integers(stats.batch))] = hi  # the logged max was reached by some sequence
    return out


def replica_decode_s(
    lengths: np.ndarray,
    slots: int,
    prompt: float,
    step_bytes: float,
    kv_token: float,
    bw: float,
    fixed: float,
) -> float:
    """Continuous batching on one replica: at most ``slots`` sequences at once; each iteration advances
    every active sequence one token and costs ``fixed`` + (weights + active KV) / bandwidth."""
    queue = lengths.tolist()  # first come, first served, in the (random) order the prompts came
    active = np.array(queue[:slots], dtype=np.int64)
    waiting = queue[slots:]
    done_tokens = np.zeros_like(active)
    t = 0.0
    while active.size:
        # Advance to the next finish: every iteration until then costs the same plus the growing KV.
        k = int((active - done_tokens).min())
        ctx = float((prompt + done_tokens).sum()) * k + active.size * k * (k + 1) / 2.0
        t += k * (fixed + step_bytes / bw) + ctx * kv_token / bw
        done_tokens = done_tokens + k
        keep = done_tokens < active
        freed = int((~keep).sum())
        active, done_tokens = active[keep], done_tokens[keep]
        if waiting and freed:
            new, waiting = waiting[:freed], waiting[freed:]
            active = np.concatenate([active, np.array(new, dtype=np.int64)])
            done_tokens = np.concatenate([done_tokens, np.zeros(len(new), dtype=np.int64)])
    return t


def generate_s(
    stats: StepStats, model: ModelSize, gpu: Gpu, c: WorldConstants, *, tp: int, dp: int, seed: int = 0
) -> float:
    """Generation time of one step: prefill, then the slowest replica's continuous batching."""
    rng = np.random.default_rng(seed)
    lengths = draw_lengths(stats, rng, c.length_concentration)
    weights = 2.0 * model.params
    free = max(gpu.memory_bytes * c.kv_share - weights / tp, 0.05 * gpu.memory_bytes)
    kv_token = model.kv_bytes_per_token / tp
    slots = max(1, int(free / (kv_token * (stats.prompt_mean + stats.response_max))))
    bw = gpu.hbm_bytes_per_s * c.hbm_efficiency
    prefill = 2.0 * model.params * stats.batch * stats.prompt_mean / (gpu.peak_flops * c.mfu * tp * dp)
    slowest = max(
        replica_decode_s(part, slots, stats.prompt_mean, weights / tp, kv_token, bw, c.decode_step_s)
        for part in np.array_split(rng.permutation(lengths), dp)
    )
    return c.generate_fixed_s + prefill + slowest


def pass_parts(
    stats: StepStats, model: ModelSize, gpu: Gpu, *, train: bool, devices: int
) -> tuple[float, float]:
    """An infer (forward) or train (forward + backward) pass over the batch on ``devices`` GPUs: its
    seconds at the full peak FLOP/s, and the Adam step's seconds (train only)."""
    tokens = stats.batch * (stats.prompt_mean + stats.response_mean)
    flops_s = (6.0 if train else 2.0) * model.params * tokens / (gpu.peak_flops * devices)
    # Adam reads and writes ~16 bytes/param of state, sharded over the devices (ZeRO/FSDP)
    adam_s = 16.0 * 2 * model.params / devices / gpu.hbm_bytes_per_s if train else 0.0
    return flops_s, adam_s


def pass_s(
    stats: StepStats, model: ModelSize, gpu: Gpu, c: WorldConstants, *, train: bool, devices: int
) -> float:
    flops_s, adam_s = pass_parts(stats, model, gpu, train=train, devices=devices)
    return (c.train_fixed_s if train else c.infer_fixed_s) + flops_s / c.mfu + adam_s


KINDS = ("generate", "infer", "train")


def stage_s(
    kind: str,
    stats: StepStats,
    model: ModelSize,
    gpu: Gpu,
    c: WorldConstants,
    *,
    tp: int,
    dp: int,
    seed: int = 0,
) -> float:
    if kind == "generate":
        return generate_s(stats, model, gpu, c, tp=tp, dp=dp, seed=seed)
    return pass_s(stats, model, gpu, c, train=kind == "train", devices=tp * dp)


def fit(
    rows: Sequence[tuple[str, StepStats, ModelSize, Gpu, int, int, float]], start: WorldConstants
) -> WorldConstants:
    """Fit the fixed costs and ``mfu`` by least squares on (kind, stats, model, gpu, tp, dp, seconds):
    each stage time is linear in its fixed cost and in the per-unit cost it scales (decode
    iterations; 1/mfu), so one linear solve per kind, clipped to physical values."""
    c = start
    gen = [r for r in rows if r[0] == "generate"]
    if gen:
        zero = replace(c, generate_fixed_s=0.0, decode_step_s=0.0)
        one = replace(zero, decode_step_s=1.0)

        def run(cs: WorldConstants) -> np.ndarray:
            return np.array(
                [generate_s(s, m, g, cs, tp=t, dp=d, seed=i) for i, (_, s, m, g, t, d, _) in enumerate(gen)]
            )

        bare = run(zero)
        per = run(one) - bare
        y = np.array([r[-1] for r in gen]) - bare
        (fixed, step), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(per), per]), y, rcond=None)
        c = replace(c, generate_fixed_s=max(float(fixed), 0.0), decode_step_s=max(float(step), 0.0))
    passes = [r for r in rows if r[0] != "generate"]
    if passes:
        parts = np.array(
            [pass_parts(s, m, g, train=k == "train", devices=t * d) for k, s, m, g, t, d, _ in passes]
        )
        is_train = np.array([r[0] == "train" for r in passes], dtype=float)
        design = np.column_stack([1.0 - is_train, is_train, parts[:, 0]])
        y = np.array([r[-1] for r in passes]) - parts[:, 1]
        (fi, ft, inv_mfu), *_ = np.linalg.lstsq(design, y, rcond=None)
        mfu = float(np.clip(1.0 / max(float(inv_mfu), 1e-9), 0.01, 0.9))
        c = replace(c, infer_fixed_s=max(float(fi), 0.0), train_fixed_s=max(float(ft), 0.0), mfu=mfu)
    return c
