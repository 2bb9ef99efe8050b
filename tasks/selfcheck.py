"""Prefect task of the runtime self-check: one model-stage's layout against the single-device reference."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nereus_core.config import NereusConfig
from nereus_core.engine.reference import reference_greedy, reference_logprobs, reference_model
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.layout import Layout
from tasks import model_ops
from tasks.runtime.device_pool import DevicePool

# Parallel log-probs agree with the reference to fp32 rounding (see tests/tasks/test_runtime.py).
TOLERANCE = 1e-4


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


@task(cache_policy=NO_CACHE, retries=0)
def check_model_stage(
    pool: DevicePool, stage: str, layout: Layout, config: NereusConfig, repeats: int = 3
) -> dict[str, Any]:
    """Load ``stage`` on ``layout``, time it and compare its outputs with the reference."""
    job, model = config.job, config.model
    gen = torch.Generator().manual_seed(job.seed)
    ids = torch.randint(
        0, model.vocab_size, (job.batch_size, job.prompt_len + job.response_len), generator=gen
    )
    reference = reference_model(model)
    train = stage.endswith("/train")
    optimizer = OptimizerSettings(lr=job.lr, weight_decay=job.weight_decay) if train else None
    start = time.perf_counter()
    pool.build_groups(layout)
    groups_s = time.perf_counter() - start
    start = time.perf_counter()
    model_ops.load_model(pool, layout, name=stage, config=model, optimizer=optimizer)
    load_s = time.perf_counter() - start
    row: dict[str, Any] = {"stage": stage, "layout": layout.key, "groups_s": groups_s, "load_s": load_s}
    try:
        if stage.endswith("/generate"):
            prompts = ids[:, : job.prompt_len]
            row["forward_s"], tokens = _median_time(
                lambda: model_ops.sample(pool, layout, prompts, name=stage, max_new_tokens=job.response_len),
                repeats,
            )
            expected = reference_greedy(reference, prompts, job.response_len)
            row["max_abs_diff"] = float((tokens != expected).sum())  # tokens that differ
        else:
            row["forward_s"], logp = _median_time(
                lambda: model_ops.forward(pool, layout, ids, name=stage), repeats
            )
            row["max_abs_diff"] = float((logp - reference_logprobs(reference, ids)).abs().max())
        if train:
            row["train_s"], _ = _median_time(
                lambda: model_ops.train(pool, layout, {"ids": ids}, name=stage), repeats
            )
    finally:
        model_ops.unload_model(pool, layout, name=stage)
    row["ok"] = row["max_abs_diff"] <= TOLERANCE
    get_run_logger().info(
        "%s on %s: max diff %.2e (%s)",
        stage,
        layout.key,
        row["max_abs_diff"],
        "ok" if row["ok"] else "MISMATCH",
    )
    return row
