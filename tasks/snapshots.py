"""Prefect task: snapshot a model-stage's parameters into the run directory's Arrow store."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from nereus_core.config import ModelConfig
from nereus_core.emu import shard_map
from nereus_core.engine.shard import shard_state
from nereus_core.layout import Layout
from storage import write_snapshot
from tasks.device_pool import DevicePool


def _snapshot(
    pool: DevicePool, run_dir: str, model: str, step: int, layout: Layout, config: ModelConfig, name: str
) -> int:
    """Replica 0's slices, one file per device, committed by one manifest; returns bytes written."""
    pieces = shard_map(config, layout, train=False).emu(0)
    devices = sorted({piece.device for _, piece in pieces})
    local = dict(zip(devices, pool.run_on(devices, shard_state, name=name), strict=True))
    shards: dict[int, dict] = {d: {} for d in devices}
    written = 0
    for spec, piece in pieces:
        tensor = local[piece.device][spec.name]
        shards[piece.device][spec.name] = (tensor, spec.slice_spec(piece))
        written += tensor.numel() * tensor.element_size()
    write_snapshot(run_dir, model, step, shards, layout=layout, meta={"model_stage": name})
    return written


@task(cache_policy=NO_CACHE, retries=1)
def snapshot_model(
    pool: DevicePool, run_dir: str, model: str, step: int, layout: Layout, config: ModelConfig, name: str
) -> tuple[int, float]:
    """Snapshot ``name`` (e.g. actor/train) as ``model`` at ``step``; returns (bytes, seconds)."""
    start = time.perf_counter()
    written = _snapshot(pool, run_dir, model, step, layout, config, name)
    return written, time.perf_counter() - start
