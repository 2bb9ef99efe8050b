"""Prefect tasks: snapshot a model-stage's whole state into the run directory, and rehydrate it.

A snapshot holds everything the stage needs to go on: parameters, and for train stages the
AdamW moments (``<param>:exp_avg``, ``<param>:exp_avg_sq``) and the step count, each distinct
box written once by one holder (``nereus_core.gtg.write_assignment``). Rehydration reads under
*any* layout exactly the boxes each new device holds (the durable path of ``tasks.reshard``), so
a job can come back on another plan or another number of devices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from nereus_core.config import ModelConfig
from nereus_core.emu import shard_map
from nereus_core.engine.reshard import ReshardJob, durable_read
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.engine.staging import drop_staged, finish_staged, staged_write
from nereus_core.gtg import write_assignment
from nereus_core.layout import Layout
from storage import commit_snapshot
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
    store = ArrowStateStore(run_dir, model, step, incarnation)
    files = write_snapshot_of(pool, _job(name, config, layout, optimizer), store, _meta(name, optimizer))
    return sum(f.size for f in files), time.perf_counter() - start


def _meta(name: str, optimizer: OptimizerSettings | None) -> dict[str, Any]:
    """What a snapshot's manifest says of its writer: the model-stage, and whether it trains."""
    return {"model_stage": name, "train": optimizer is not None}


@dataclass(frozen=True)
class StagedSnapshot:
    """A snapshot whose pieces are staged in host memory and being written in the background."""

    model: str
    step: int
    layout: Layout
    meta: dict[str, Any]
    incarnation: int | None
    key: str


def stage_snapshot(
    pool: DevicePool,
    run_dir: str,
    model: str,
    step: int,
    layout: Layout,
    config: ModelConfig,
    name: str,
    optimizer: OptimizerSettings | None = None,
    incarnation: int | None = None,
    in_place: bool = False,
) -> StagedSnapshot:
    """``snapshot_model``'s pieces copied to host memory on their devices and written there in the
    background (``engine.staging``); ``finish_snapshot`` commits it once written. ``in_place``: the
    shard is never written again (``engine.staging.staged_write``): pieces in host memory not copied."""
    job = _job(name, config, layout, optimizer)
    assignment = write_assignment(job.old_map)
    store = ArrowStateStore(run_dir, model, step, incarnation)
    key = f"{model}@{step}"
    args = [(assignment[d],) for d in layout.devices]
    pool.run(layout, staged_write, args, job=job, store=store, key=key, in_place=in_place)
    return StagedSnapshot(model, step, layout, _meta(name, optimizer), incarnation, key)


def finish_snapshot(pool: DevicePool, run_dir: str, staged: StagedSnapshot) -> int:
    """Wait for ``staged``'s background writes and commit the snapshot; returns the bytes written."""
    files = pool.run_on(staged.layout.devices, finish_staged, key=staged.key)
    commit_snapshot(
        run_dir,
        staged.model,
        staged.step,
        files,
        layout=staged.layout,
        meta=staged.meta,
        incarnation=staged.incarnation,
    )
    return sum(f.size for f in files)


def drop_snapshot(pool: DevicePool, staged: StagedSnapshot) -> None:
    """Forget ``staged``'s background writes (their files stay uncommitted: a partial snapshot)."""
    pool.run_on(staged.layout.devices, drop_staged, key=staged.key)


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
