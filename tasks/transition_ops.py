"""Prefect tasks of a transition: move one model-stage's state to its new layout, or re-link a copy.

Each task is idempotent with respect to the journal: the flow skips an operation
whose ``done`` line is recorded, and a half-run one is redone from the state the
devices hold (the old shard stays resident until the new one is installed). A live switch that
keeps its old shards rolls back in memory when it fails (``restore_stage``) and frees them once
it commits (``release_kept``).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from nereus_core.config import ModelConfig
from nereus_core.emu import shard_map
from nereus_core.engine.rollback import release_retired, restore_shard
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
    keep_old: bool = False,
) -> dict[str, Any]:
    """Reshard model-stage ``name`` (parameters, and optimizer state for train stages) old -> new;
    ``keep_old``: the devices keep the old shard aside until ``release_kept`` or ``restore_stage``."""
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
        keep_old=keep_old,
    )


@task(cache_policy=NO_CACHE, retries=0)
def move_stages(
    pool: DevicePool,
    moves: list[tuple[str, ModelConfig, Layout, Layout, OptimizerSettings | None]],
    keep_old: bool = False,
) -> list[dict[str, Any]]:
    """Live-reshard several model-stages at once (one GTG wave): ``(name, config, old, new,
    optimizer)`` each, every device running its part of all of them in one call."""
    return reshard_wave(pool, moves, keep_old=keep_old)


def release_kept(pool: DevicePool) -> float:
    """Every device forgets the old shards a committed switch kept (``engine.rollback``); seconds."""
    start = time.perf_counter()
    pool.run_on(list(range(pool.size)), release_retired)
    return time.perf_counter() - start


@task(cache_policy=NO_CACHE, retries=0)
def restore_stage(
    pool: DevicePool, name: str, config: ModelConfig, layout: Layout, optimizer: OptimizerSettings | None
) -> dict[str, Any]:
    """Model-stage ``name`` back on ``layout`` (plan A) in a world rebuilt after a failed live switch,
    from the shards its devices kept or still hold, bitwise (``engine.rollback.restore_shard``)."""
    start = time.perf_counter()
    pool.build_groups(layout)
    smap = shard_map(config, layout, train=optimizer is not None)
    pool.run_on(list(range(pool.size)), restore_shard, name=name, smap=smap, optimizer=optimizer)
    return {"seconds": time.perf_counter() - start, "bytes_moved": 0}


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
