"""Fit the simulated world's activation bytes on published peak memory, and check the rest of its
memory accounting (``nereus_core/sim/memory.py``) on the same runs.

Prints JSON: the fitted ``ACTIVATION_BYTES`` (bytes per token, layer and hidden unit of a layer that
keeps its activations; ``memory.ACTIVATION_BYTES`` is what it printed) and, per run, the published
GiB, the world's and their ratio.

Runs (pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``, Llama 3.1 8B on H100 96 GB,
FSDP2, bf16 compute with fp32 sharded parameters and AdamW, peak reserved memory):
- ``M1`` fitted: 8 GPUs, local batch 2 sequences of 8,192 tokens (the run's default ``seq_len``),
  selective (op) activation checkpointing: 82.4 GiB.
- ``M2`` fitted: the same on 128 GPUs: 67.0 GiB.
- ``M3`` check, an upper bound: 8 GPUs, 32,768 tokens per GPU, full activation checkpointing,
  Float8 and torch.compile: 83.9 GiB (every row of that table sits near the card's limit: the
  allocator may fill it).
Selective checkpointing keeps the matmul outputs, most of a layer's activations; the world takes
the fitted figure as a whole layer's, so a pass without checkpointing may need more than it says.

    python -m benchmarks.fit_world_memory
"""

from __future__ import annotations

import json

import numpy as np

from nereus_core.sim import memory
from nereus_core.sim.stage_world import ModelSize, Shape

GIB = 2.0**30
# Llama 3.1 8B (config.json): 32 layers, hidden 4096, 8 KV heads of 128, FFN 14336, vocab 128256.
LAYER = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
LLAMA31_8B = ModelSize(
    params=32 * LAYER + 2 * 128256 * 4096,
    layers=32,
    kv_bytes_per_token=2 * 32 * 1024 * 2,
    hidden=4096,
    head_params=128256 * 4096,
)
RUNS = (  # id, GPUs, tokens per GPU, full recomputation, published GiB, fitted
    ("M1", 8, 16384, False, 82.4, True),
    ("M2", 128, 16384, False, 67.0, True),
    ("M3", 8, 32768, True, 83.9, False),
)


def world_gib(gpus: int, tokens: int, recompute: bool, activation_bytes: float) -> float:
    """The world's bytes on one GPU of a run, at ``activation_bytes``."""
    shape = Shape(dp=gpus)
    lengths = np.full(gpus, tokens, dtype=np.int64)  # one packed row of the GPU's tokens per replica
    held = memory.pass_bytes(
        lengths,
        0.0,
        LLAMA31_8B,
        shape,
        train=True,
        recompute=recompute,
        sharded=True,
        activation_bytes=activation_bytes,
    )
    return (held.persistent + held.transient) / GIB


def main() -> None:
    fitted = [r for r in RUNS if r[5]]
    # Linear in the activation bytes: solve on the fitted runs by least squares.
    base = np.array([world_gib(g, t, rc, 0.0) for _, g, t, rc, _, _ in fitted])
    per = np.array([world_gib(g, t, rc, 1.0) for _, g, t, rc, _, _ in fitted]) - base
    y = np.array([r[4] for r in fitted]) - base
    a = float(np.linalg.lstsq(per[:, None], y, rcond=None)[0][0])
    rows = []
    for run, gpus, tokens, recompute, published, is_fit in RUNS:
        w = world_gib(gpus, tokens, recompute, a)
        rows.append(
            {
                "run": run,
                "fitted": is_fit,
                "published_gib": published,
                "world_gib": round(w, 2),
                "ratio": round(w / published, 3),
            }
        )
    print(json.dumps({"activation_bytes": round(a, 2), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
