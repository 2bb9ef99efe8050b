"""Prefect tasks: snapshot a model-stage's whole state into the run directory, and rehydrate it.

A snapshot holds everything the stage needs to go on: parameters, and for train stages the
AdamW moments (``<param>:exp_avg``, ``<param>:exp_avg_sq``) and the step count, each distinct
box written once by one holder (``nereus_core.gtg.write_assignment``). Rehydration reads under
*any* layout exactly the boxes each new device holds (the durable path of ``tasks.reshard``), so
a job can come back on another plan or another number of devices.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from nereus_core.config import ModelConfig
from nereus_core.emu import shard_map
from nereus_core.engine.reshard import ReshardJob, durable_read, durable_write
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.gtg import write_assignment
from nereus_core.layout import Layout
from storage import commit_snapshot
from tasks.device_pool import DevicePool
from tasks.reshard import ArrowStateStore


def write_state(
    pool: DevicePool,
    run_dir: str,
    model: str,
    step: int,
    layout: Layout,
    config: ModelConfig,
    name: str,
    optimizer: OptimizerSettings | None,
    meta: dict[str, Any] | None = None,
) -> int:
    """Write ``name``'s state as snapshot ``state/<model>/step=<step>`` and commit it; returns bytes."""
    smap = shard_map(config, layout, train=optimizer is not None)
    job = ReshardJob(name, config, smap, smap, optimizer)
    assignment = write_assignment(smap)
    store = ArrowStateStore(run_dir, model, step)
    files = pool.run(layout, durable_write, [(assignment[d],) for d in layout.devices], job=job, store=store)
    commit_snapshot(
        run_dir,
        model,
        step,
        files,
        layout=layout,
        meta={"model_stage": name, "train": optimizer is not None, **(meta or {})},
    )
    return sum(f.size for f in files)


def read_state(
    pool: DevicePool,
    run_dir: str,
    model: str,
    step: int,
    layout: Layout,
    config: ModelConfig,
    name: str,
    optimizer: OptimizerSettings | None,
) -> dict[str, Any]:
    """Make ``name`` resident on ``layout`` from snapshot ``state/<model>/step=<step>`` (any layout)."""
    smap = shard_map(config, layout, train=optimizer is not None)
    job = ReshardJob(name, config, smap, smap, optimizer)
    pool.build_groups(layout)
    figures = pool.run_on(layout.devices, durable_read, job=job, store=ArrowStateStore(run_dir, model, step))
    return {"bytes_read": sum(f["read"] for f in figures), "read_s": max(f["read_s"] for f in figures)}


@task(cache_policy=NO_CACHE)  # no retries: a failed write leaves the previous checkpoint in force
def snapshot_model(
    pool: DevicePool,
    run_dir: str,
    model: str,
    step: int,
    layout: Layout,
    config: ModelConfig,
    name: str,
    optimizer: OptimizerSettings | None = None,
) -> tuple[int, float]:
    """Snapshot ``name`` (e.g. actor/train) as ``model`` at ``step``; returns (bytes, seconds)."""
    start = time.perf_counter()
    written = write_state(pool, run_dir, model, step, layout, config, name, optimizer)
    return written, time.perf_counter() - start


@task(cache_policy=NO_CACHE)
def rehydrate_model(
    pool: DevicePool,
    run_dir: str,
    model: str,
    step: int,
    layout: Layout,
    config: ModelConfig,
    name: str,
    optimizer: OptimizerSettings | None = None,
) -> dict[str, Any]:
    """Load ``name`` on ``layout`` from the snapshot of ``model`` at ``step``; returns its figures."""
    start = time.perf_counter()
    figures = read_state(pool, run_dir, model, step, layout, config, name, optimizer)
    return {**figures, "seconds": time.perf_counter() - start}
