"""Prefect tasks of a transition: move one model-stage's state to its new layout, or re-link a copy.

Each task is idempotent with respect to the journal: the flow skips an operation
whose ``done`` line is recorded, and a half-run one is redone from the state the
devices hold (the old shard stays resident until the new one is installed).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from nereus_core.config import ModelConfig
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.layout import Layout
from tasks import model_ops
from tasks.reshard import reshard, reshard_wave, sync_copy
from tasks.runtime.device_pool import DevicePool


@task(cache_policy=NO_CACHE, retries=0)
def move_stage(
    pool: DevicePool,
    name: str,
    config: ModelConfig,
    old: Layout,
    new: Layout,
    *,
    path: str,
    optimizer: OptimizerSettings | None,
    run_dir: str,
    step: int,
) -> dict[str, Any]:
    """Reshard model-stage ``name`` (parameters, and optimizer state for train stages) old -> new."""
    return reshard(
        pool,
        name,
        config,
        old,
        new,
        path=path,  # type: ignore[arg-type]
        optimizer=optimizer,
        run_dir=run_dir,
        store_model=f"transition-{name.replace('/', '-')}",
        step=step,
    )


@task(cache_policy=NO_CACHE, retries=0)
def move_stages(
    pool: DevicePool,
    moves: list[tuple[str, ModelConfig, Layout, Layout, OptimizerSettings | None]],
) -> list[dict[str, Any]]:
    """Live-reshard several model-stages at once (one GTG wave): ``(name, config, old, new,
    optimizer)`` each, every device running its part of all of them in one call."""
    return reshard_wave(pool, moves)


@task(cache_policy=NO_CACHE, retries=1)
def relink_copy(
    pool: DevicePool,
    name: str,
    source: str,
    source_layout: Layout,
    layout: Layout,
    config: ModelConfig,
) -> dict[str, Any]:
    """Make inference stage ``name`` follow ``source`` again: share its shards on the same layout,
    else build it on ``layout`` and copy ``source``'s parameters in, device to device."""
    start = time.perf_counter()
    pool.build_groups(layout)
    if layout == source_layout:
        model_ops.alias_model(pool, layout, name=name, target=source)
        moved = 0
    else:
        where = {"source_layout": source_layout, "copy_layout": layout}
        moved = sync_copy(pool, config, source=source, copy=name, create=True, **where)["bytes_moved"]
    return {"seconds": time.perf_counter() - start, "bytes_moved": moved, "path": "relink"}
