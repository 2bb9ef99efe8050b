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
from nereus_core.engine.reshard import ReshardJob, durable_read
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.layout import Layout
from tasks.reshard import ArrowStateStore, write_snapshot_of
from tasks.runtime.device_pool import DevicePool


def _job(name: str, config: ModelConfig, layout: Layout, optimizer: OptimizerSettings | None) -> ReshardJob:
    """The reshard job of ``name`` onto its own layout: what the durable write and read run with."""
    smap = shard_map(config, layout, train=optimizer is not None)
    return ReshardJob(name, config, smap, smap, optimizer)


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
    incarnation: int | None = None,
) -> tuple[int, float]:
    """Write ``name``'s state (e.g. actor/train's) as snapshot ``state/<model>/step=<step>`` and commit
    it, stamped with the driver's ``incarnation`` (``RunDir.identity()``); returns (bytes, seconds)."""
    start = time.perf_counter()
    meta = {"model_stage": name, "train": optimizer is not None}
    store = ArrowStateStore(run_dir, model, step, incarnation)
    files = write_snapshot_of(pool, _job(name, config, layout, optimizer), store, meta)
    return sum(f.size for f in files), time.perf_counter() - start


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
    incarnation: int | None = None,
) -> dict[str, Any]:
    """Make ``name`` resident on ``layout`` from the snapshot of ``model`` at ``step`` (any layout wrote
    it; with ``incarnation``, the checkpoint record's, only one that incarnation wrote); returns bytes
    read and seconds."""
    start = time.perf_counter()
    pool.build_groups(layout)
    job = _job(name, config, layout, optimizer)
    store = ArrowStateStore(run_dir, model, step, incarnation)
    figures = pool.run_on(layout.devices, durable_read, job=job, store=store)
    return {"bytes_read": sum(f["read"] for f in figures), "seconds": time.perf_counter() - start}
