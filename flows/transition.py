"""The transition subflow: switch the running job from plan A to plan B, journaled.

    journal: transition start (plans, reason, route, the checkpoint plan A is safe in)
      live route (same devices; the GTG found a memory-safe order):
      -> each model-stage whose layout changes, in the GTG's order: move_stage (P2P reshard of
         parameters + AdamW state); stages the GTG sends durable: rehydrate from the checkpoint
      durable route (the device set changes, or no live order exists):
      -> drop every shard -> resize the pool (a new world) -> rehydrate every model-stage under
         plan B from the checkpoint (a device lost meanwhile: rebuild the world, rehydrate again)
      -> inference copies of trained models (actor/generate, critic/infer): relink
      -> journal: commit (the plan switch); the job continues on plan B
Every operation writes a ``start`` line before it runs and a ``done`` line after, so after a
crash the journal says how far it got; ``nereus resume`` then finishes the switch from the
checkpoint (plan B) or rolls it back (plan A), see flows/ppo_job.py.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from prefect import flow, get_run_logger

from nereus_core import faults
from nereus_core.config import ModelConfig, NereusConfig
from nereus_core.engine.shard import OptimizerSettings, drop_all
from nereus_core.gtg import TransitionInfeasible, build_gtg
from nereus_core.layout import Layout
from nereus_core.plan import model_of, models_for
from storage.journal import ABORT, COMMIT, DONE, FAILED, START, Journal
from tasks import model_ops
from tasks.device_pool import DevicePool
from tasks.snapshots import rehydrate_model
from tasks.transition_ops import move_stage, relink_copy

COPIES = {"actor/generate": "actor/train", "critic/infer": "critic/train"}
OWN_STATE = ("actor/train", "critic/train", "reference/infer", "reward/infer")


def stage_config(cfg: NereusConfig, stage: str) -> ModelConfig:
    """The model config of a model-stage: critic and reward carry the value head."""
    return models_for(cfg.model)[model_of(stage)]


def optimizer_settings(cfg: NereusConfig, stage: str) -> OptimizerSettings | None:
    """AdamW settings of a train model-stage (None for an inference stage)."""
    if not stage.endswith("/train"):
        return None
    lr = cfg.ppo.actor_lr if stage.startswith("actor") else cfg.ppo.critic_lr
    return OptimizerSettings(lr=lr, weight_decay=cfg.job.weight_decay)


def _run_op(journal: Journal, op_id: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    if op_id in journal.done_ops():
        return {"seconds": 0.0, "bytes_moved": 0, "skipped": True}
    journal.record(op_id, START)
    stats = fn(*args, **kwargs)
    journal.record(op_id, DONE, seconds=stats.get("seconds", 0.0), bytes_moved=stats.get("bytes_moved", 0))
    return stats


def _stage_order(graph: Any, stages: list[str]) -> list[str]:
    """Changed stages in the order their first operation runs in the GTG's wave schedule."""

    def first_wave(stage: str) -> int:
        waves = (i for i, wave in enumerate(graph.waves) for op in wave if f":{stage}" in op)
        return next(waves, len(graph.waves))

    return sorted(stages, key=lambda s: (first_wave(s), OWN_STATE.index(s)))


def rehydrate_all(
    pool: DevicePool,
    cfg: NereusConfig,
    run_dir: str,
    journal: Journal,
    plan: dict[str, Layout],
    checkpoint_step: int,
    devices: int,
) -> int:
    """Drop every shard, resize the pool to ``devices`` (a new world), load every model-stage of
    ``plan`` from the checkpoint and relink the inference copies; returns bytes read. A device
    lost during rehydration costs one world rebuild and a second pass (then it raises)."""
    logger = get_run_logger()
    _run_op(journal, "drop:all", _drop_all, pool)
    if devices != pool.size:
        _run_op(journal, f"resize:{pool.size}->{devices}", _resize, pool, devices)
    read = 0
    for attempt in (1, 2):
        try:
            if faults.armed("kill-worker:rehydrate"):
                pid = pool.info()[min(1, pool.size - 1)]["pid"]
                logger.warning("fault injection: killing device worker pid %d during rehydration", pid)
                os.kill(pid, signal.SIGKILL)
            for stage in OWN_STATE:
                model = model_of(stage)
                stats = _run_op(
                    journal,
                    f"rehydrate:{stage}#{attempt}",
                    rehydrate_model,
                    pool,
                    run_dir,
                    model,
                    checkpoint_step,
                    plan[stage],
                    stage_config(cfg, stage),
                    stage,
                    optimizer_settings(cfg, stage),
                )
                read += stats.get("bytes_read", 0)
            break
        except Exception as err:
            journal.record(f"rehydrate#{attempt}", FAILED, error=f"{type(err).__name__}: {err}"[:500])
            if attempt == 2:
                raise
            logger.warning("rehydration failed (%s); rebuilding the world and rehydrating again", err)
            _resize(pool, devices)  # a lost worker is replaced; every group is rebuilt
            _drop_all(pool)
    for copy, source in COPIES.items():
        stats = _run_op(
            journal,
            f"relink:{copy}",
            relink_copy,
            pool,
            copy,
            source,
            plan[source],
            plan[copy],
            stage_config(cfg, copy),
        )
        read += stats.get("bytes_moved", 0)
    return read


def _drop_all(pool: DevicePool) -> dict[str, Any]:
    pool.run_on(list(range(pool.size)), drop_all)
    return {}


def _resize(pool: DevicePool, devices: int) -> dict[str, Any]:
    """A new world of ``devices`` slots, DeepSpeed warmed up on every one (new workers pay seconds
    for their first engine: here, not in the first step or transition that uses them)."""
    start = time.perf_counter()
    pool.resize(devices)
    resized = time.perf_counter()
    model_ops.warm_up(pool)
    return {"seconds": time.perf_counter() - start, "resize_s": resized - start}


@flow(name="nereus-transition", validate_parameters=False)
def transition_flow(
    pool: DevicePool,
    cfg: NereusConfig,
    run_dir: str,
    transition_id: str,
    old: dict[str, Layout],
    new: dict[str, Layout],
    *,
    step: int,
    reason: str,
    path: str = "live",
    checkpoint_step: int | None = None,
    devices: int | None = None,
) -> dict[str, Any]:
    """Move every model-stage whose layout differs from ``old`` to ``new``; returns the figures.

    ``checkpoint_step``: every model's state at this step is committed in the run directory
    (``state/<model>/step=N``, plan A's state): the durable route rehydrates from it, and
    ``nereus resume`` finishes an interrupted switch from it. ``devices``: the pool's size under
    plan B (a change takes the durable route; it needs the checkpoint).
    """
    logger = get_run_logger()
    journal = Journal(run_dir, transition_id)
    target = pool.size if devices is None else devices
    resize = target != pool.size
    if resize and checkpoint_step is None:
        raise ValueError("changing the device set rebuilds the world: give checkpoint_step")
    capacities = {d: int(cfg.cluster.memory_per_device) for d in range(max(pool.size, target))}
    models = {s: (stage_config(cfg, s), s.endswith("/train")) for s in OWN_STATE}
    try:
        # The GTG orders the moves so no device overflows, and routes through the store when it must.
        graph = build_gtg(
            {s: old[s] for s in OWN_STATE},
            {s: new[s] for s in OWN_STATE},
            models,
            capacities,
            allow_live=not resize,
        )
    except TransitionInfeasible as err:
        journal.record("transition", ABORT, step=step, reason=reason, error=str(err))
        logger.warning("transition %s refused before any move: %s", transition_id, err)
        return {"seconds": 0.0, "bytes_moved": 0, "operations": 0, "status": "refused", "error": str(err)}
    route = "durable" if resize else graph.route
    route_reason = (
        f"the device set changes ({pool.size} -> {target} slots): the world is rebuilt"
        if resize
        else graph.reason
    )
    journal.record(
        "transition",
        START,
        step=step,
        reason=reason,
        path=path,
        route=route,
        route_reason=route_reason,
        critical_path_s=graph.critical_path_s,
        checkpoint_step=checkpoint_step,
        devices_before=pool.size,
        devices=target,
        old={k: v.model_dump(mode="json") for k, v in old.items()},
        new={k: v.model_dump(mode="json") for k, v in new.items()},
    )
    logger.info(
        "GTG: route %s (%s), %d ops, critical path %.3f s",
        route,
        route_reason,
        len(graph.ops),
        graph.critical_path_s,
    )
    start = time.perf_counter()
    moved, ops = 0, 0
    try:
        if route == "durable" and checkpoint_step is not None:
            moved = rehydrate_all(pool, cfg, run_dir, journal, new, checkpoint_step, target)
            ops = len(OWN_STATE) + len(COPIES)
        else:
            moved, ops = _move_changed(
                pool, cfg, run_dir, journal, graph, old, new, step, path, checkpoint_step
            )
    except BaseException as err:
        journal.record("transition", ABORT, error=f"{type(err).__name__}: {err}"[:500])
        raise
    seconds = time.perf_counter() - start
    journal.record("transition", COMMIT, seconds=seconds, bytes_moved=moved)
    return {
        "seconds": seconds,
        "bytes_moved": moved,
        "operations": ops,
        "status": "committed",
        "route": route,
        "gtg_critical_path_s": graph.critical_path_s,
    }


def _move_changed(
    pool: DevicePool,
    cfg: NereusConfig,
    run_dir: str,
    journal: Journal,
    graph: Any,
    old: dict[str, Layout],
    new: dict[str, Layout],
    step: int,
    path: str,
    checkpoint_step: int | None,
) -> tuple[int, int]:
    """The live route: each changed stage moved in the GTG's order (durable ones from the checkpoint)."""
    logger = get_run_logger()
    moved, ops = 0, 0
    changed = [s for s in OWN_STATE if old[s] != new[s]]
    for stage in _stage_order(graph, changed):
        if faults.armed("kill-driver:move"):
            journal.record(f"move:{stage}", START)
            logger.warning("fault injection: the driver dies while moving %s", stage)
            os.kill(os.getpid(), signal.SIGKILL)
        if stage in graph.durable_stages and checkpoint_step is not None:
            model_ops.unload_model(pool, old[stage], name=stage)
            stats = _run_op(
                journal,
                f"rehydrate:{stage}",
                rehydrate_model,
                pool,
                run_dir,
                model_of(stage),
                checkpoint_step,
                new[stage],
                stage_config(cfg, stage),
                stage,
                optimizer_settings(cfg, stage),
            )
            stats["bytes_moved"] = stats.get("bytes_read", 0)
        else:
            stats = _run_op(
                journal,
                f"move:{stage}",
                move_stage,
                pool,
                stage,
                stage_config(cfg, stage),
                old[stage],
                new[stage],
                path=path,
                optimizer=optimizer_settings(cfg, stage),
                run_dir=run_dir,
                step=step,
            )
        moved, ops = moved + stats.get("bytes_moved", 0), ops + 1
        logger.info(
            "moved %s %s -> %s (%s bytes)", stage, old[stage].key, new[stage].key, stats.get("bytes_moved")
        )
    for copy, source in COPIES.items():
        if old[copy] == new[copy] and old[source] == new[source]:
            continue
        model_ops.unload_model(pool, old[copy], name=copy)
        stats = _run_op(
            journal,
            f"relink:{copy}",
            relink_copy,
            pool,
            copy,
            source,
            new[source],
            new[copy],
            stage_config(cfg, copy),
        )
        moved, ops = moved + stats.get("bytes_moved", 0), ops + 1
    return moved, ops
