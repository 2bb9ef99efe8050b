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
from tasks.device_pool import DevicePool
from tasks.reshard import reshard


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
    else load a fresh copy of its weights on ``layout``."""
    start = time.perf_counter()
    pool.build_groups(layout)
    if layout == source_layout:
        model_ops.alias_model(pool, layout, name=name, target=source)
        moved = 0
    else:
        state = model_ops.full_state(pool, source_layout, name=source, config=config)
        model_ops.load_model(pool, layout, name=name, config=config, full_state=state)
        moved = sum(t.numel() * t.element_size() for t in state.values()) * layout.world_size
    return {"seconds": time.perf_counter() - start, "bytes_moved": moved, "path": "relink"}
