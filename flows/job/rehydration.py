"""Journaled units a transition shares with a resume: run an op once, relink the inference copies,
and rebuild every model-stage on another device set from a checkpoint.

    rehydrate_all: drop every shard -> resize the pool (a new world) -> rehydrate every model-stage
      of the plan from the checkpoint (a device lost meanwhile: rebuild, again) -> relink the copies
Every op writes a ``start`` line before it runs and a ``done`` line after; one already done is
skipped (``run_op``), so a resumed switch does not redo it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from prefect import get_run_logger

from nereus_core import faults
from nereus_core.config import NereusConfig
from nereus_core.engine.shard import drop_all
from nereus_core.job import model_config, optimizer_settings
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan, ModelStage, StageLayouts, copies, own_state
from storage.journal import DONE, FAILED, START, Journal
from storage.run_dir import RunDir
from tasks import model_ops
from tasks.runtime.device_pool import DevicePool
from tasks.snapshots import rehydrate_model
from tasks.transition_ops import relink_copy


def run_op(journal: Journal, op_id: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    if op_id in journal.done_ops():
        return {"seconds": 0.0, "bytes_moved": 0, "skipped": True}
    journal.record(op_id, START)
    stats = fn(*args, **kwargs) or {}
    journal.record(op_id, DONE, seconds=stats.get("seconds", 0.0), bytes_moved=stats.get("bytes_moved", 0))
    return stats


def rehydrate_stage(
    pool: DevicePool, cfg: NereusConfig, run_dir: str, step: int, stage: str, layout: Layout
) -> dict:
    stats = rehydrate_model(
        pool,
        run_dir,
        ModelStage(stage).model,
        step,
        layout,
        model_config(cfg, stage),
        stage,
        optimizer_settings(cfg, stage),
        incarnation=RunDir(run_dir).read_checkpoint(step)["incarnation"],  # the checkpoint's own writer
    )
    return {**stats, "bytes_moved": stats.get("bytes_read", 0)}


def relink(pool: DevicePool, cfg: NereusConfig, journal: Journal, plan: StageLayouts, relinked: list) -> int:
    moved, sources = 0, copies(plan)
    for copy in relinked:
        source = sources[copy]
        stats = run_op(
            journal,
            f"relink:{copy}",
            relink_copy,
            pool,
            copy,
            source,
            plan[source],
            plan[copy],
            model_config(cfg, copy),
        )
        moved += stats.get("bytes_moved", 0)
    return moved


def rehydrate_all(
    pool: DevicePool,
    cfg: NereusConfig,
    run_dir: str,
    journal: Journal,
    new: GlobalPlan,
    checkpoint_step: int,
    devices: int,
) -> int:
    """Drop every shard, resize the pool to ``devices`` (a new world), load every model-stage of
    ``new`` from the checkpoint and relink the inference copies; returns bytes read. A device
    lost during rehydration costs one world rebuild and a second pass (then it raises)."""
    logger, plan = get_run_logger(), new.layouts
    run_op(journal, "drop:all", _drop_all, pool)
    if devices != pool.size:
        run_op(journal, f"resize:{pool.size}->{devices}", _resize, pool, devices)
    read = 0
    for attempt in (1, 2):
        try:
            if faults.armed("kill-worker:rehydrate"):
                pid = pool.info()[min(1, pool.size - 1)]["pid"]
                logger.warning("fault injection: killing device worker pid %d during rehydration", pid)
                os.kill(pid, signal.SIGKILL)
            for stage in own_state(plan):
                op = f"rehydrate:{stage}#{attempt}"
                read += run_op(
                    journal, op, rehydrate_stage, pool, cfg, run_dir, checkpoint_step, stage, plan[stage]
                )["bytes_moved"]
            break
        except Exception as err:
            journal.record(f"rehydrate#{attempt}", FAILED, error=f"{type(err).__name__}: {err}"[:500])
            if attempt == 2:
                raise
            logger.warning("rehydration failed (%s); rebuilding the world and rehydrating again", err)
            _resize(pool, devices)  # a lost worker is replaced; every group is rebuilt
            _drop_all(pool)
    return read + relink(pool, cfg, journal, plan, list(copies(plan)))


def _drop_all(pool: DevicePool) -> dict[str, Any]:
    pool.run_on(list(range(pool.size)), drop_all)
    return {}


def _resize(pool: DevicePool, devices: int) -> dict[str, Any]:
    """A new world of ``devices`` slots, DeepSpeed warmed up on the workers new to it (a new worker
    pays seconds for its first engine: here, not in the first step that uses it). Workers the job
    prepared for this grow (``DevicePool.prepare``) joined warm: only the world is formed."""
    start = time.perf_counter()
    pool.resize(devices)
    resized = time.perf_counter()
    model_ops.warm_up(pool, pool.cold_ranks)
    return {"seconds": time.perf_counter() - start, "resize_s": resized - start}
