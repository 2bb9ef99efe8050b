"""vLLM against Nereus's own sampler as actor/generate, side by side in one run (JSON out).

On one device slot of the CPU pool, the same seeded Llama-style model (about 100M parameters by
default), the same prompts and lengths:

- ``nereus``: ``model_ops.sample`` (the KV-cache sampler on the device actor), tokens/s;
- ``vllm``: an engine process (``tasks.rollout_engines``): its start seconds, tokens/s of one
  warm generate call, and its log-prob of every sampled token against the teacher-forced one of
  Nereus's decoder on the same weights (max and mean difference);
- ``sync``: the in-place weight sync after a train step (the device writes its slices to shared
  memory, the engine reloads from them): seconds per sync (median of ``--syncs``), the bytes it
  moves and their rate, beside ``file_floor_s``: writing and reading those bytes as one
  safetensors file in the same folder with nothing else (the floor of the file path).

Sampling at temperature 1, every response the full length (no stop ids) for both engines.

    python -m benchmarks.bench_vllm [--prompts 64] [--tokens 128] [--prompt-len 32] [--syncs 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nereus_core.config import ClusterConfig, ModelConfig
from nereus_core.config.rollout import RolloutConfig
from nereus_core.engine.sampling import SamplingRequest
from nereus_core.layout import Layout
from nereus_core.model.weights import param_shapes
from nereus_core.rl.rollout import response_logp
from tasks import model_ops, rollout_engines
from tasks.runtime.device_pool import DevicePool

# About 100M parameters (49M of them the untied embedding and head), head_dim 64 (vLLM's CPU
# attention needs at least 32).
MODEL = ModelConfig(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    seed=0,
)
NAME, ENGINE = "bench/actor", "bench/generate"


def _nereus(pool: DevicePool, layout: Layout, prompts: torch.Tensor, tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    model_ops.sample(pool, layout, prompts, name=NAME, max_new_tokens=tokens, temperature=1.0, seed=1)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens_per_s": prompts.numel() / prompts.shape[1] * tokens / seconds}


def _vllm(
    pool: DevicePool, layout: Layout, engines: rollout_engines.Engines, prompts: torch.Tensor, tokens: int
) -> dict[str, Any]:
    warm = SamplingRequest(max_new_tokens=2, temperature=1.0, seed=0)
    rollout_engines.generate(pool, engines, prompts[:2], request=warm)
    request = SamplingRequest(max_new_tokens=tokens, temperature=1.0, seed=1)
    start = time.perf_counter()
    ids, logp = rollout_engines.generate(pool, engines, prompts, request=request)
    seconds = time.perf_counter() - start
    full = torch.cat([prompts, ids], dim=1)
    forced = response_logp(model_ops.forward(pool, layout, full, name=NAME), tokens)
    gap = (forced - logp).abs()
    return {
        "seconds": seconds,
        "tokens_per_s": ids.numel() / seconds,
        "logp_diff_max": float(gap.max()),
        "logp_diff_mean": float(gap.mean()),
    }


def _file_floor(pool: DevicePool, layout: Layout, directory: str) -> float:
    """Write and read the model's whole state as one safetensors file in ``directory``."""
    state = model_ops.full_state(pool, layout, name=NAME, config=MODEL)
    path = Path(directory) / "floor.safetensors"
    start = time.perf_counter()
    save_file(state, str(path))
    load_file(str(path))
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def run(*, prompts: int, tokens: int, prompt_len: int, syncs: int) -> dict[str, Any]:
    layout = Layout.contiguous()
    ids = torch.randint(
        0, MODEL.vocab_size, (prompts, prompt_len), generator=torch.Generator().manual_seed(0)
    )
    out: dict[str, Any] = {
        "model": {"params": sum(math.prod(s) for s in param_shapes(MODEL).values()), "dtype": MODEL.dtype},
        "prompts": prompts,
        "prompt_len": prompt_len,
        "tokens": tokens,
        "load_avg_start": os.getloadavg()[0],
    }
    with DevicePool.for_cluster(ClusterConfig(devices=1)) as pool:
        model_ops.load_model(pool, layout, name=NAME, config=MODEL)
        out["nereus"] = _nereus(pool, layout, ids, tokens)
        settings = RolloutConfig(kv_cache_memory_bytes=1 << 30, max_num_seqs=max(prompts, 16))
        start = time.perf_counter()
        engines, _ = rollout_engines.start(
            pool,
            layout,
            name=ENGINE,
            config=MODEL,
            settings=settings,
            max_model_len=prompt_len + tokens,
            seed=0,
        )
        try:
            out["vllm_start_s"] = time.perf_counter() - start
            rollout_engines.sync(pool, engines, layout, source=NAME)  # the first: the model's weights
            out["vllm"] = _vllm(pool, layout, engines, ids, tokens)
            figures = [rollout_engines.sync(pool, engines, layout, source=NAME) for _ in range(syncs)]
            seconds = [f["seconds"] for f in figures]
            out["sync"] = {
                "seconds_median": statistics.median(seconds),
                "seconds": seconds,
                "write_s": [f["write_s"] for f in figures],
                "reload_s": [f["reload_s"] for f in figures],
                "bytes": figures[0]["bytes"],
                "gb_per_s": figures[0]["bytes"] / statistics.median(seconds) / 1e9,
                "file_floor_s": _file_floor(pool, layout, engines.work_dir),
            }
        finally:
            rollout_engines.stop(pool, engines)
    out["speedup"] = out["vllm"]["tokens_per_s"] / out["nereus"]["tokens_per_s"]
    out["load_avg_end"] = os.getloadavg()[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    result = run(prompts=args.prompts, tokens=args.tokens, prompt_len=args.prompt_len, syncs=args.syncs)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
