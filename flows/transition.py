"""The transition subflow: switch the running job from plan A to plan B, journaled.

    journal: transition start (plans, reason)
      -> for each trained model-stage whose layout changes: move_stage (live P2P reshard of
         parameters + AdamW state; durable through the Arrow store when asked)
      -> for each other model-stage whose layout changes: move_stage (parameters)
      -> inference copies of trained models (actor/generate, critic/infer): relink
      -> journal: commit (the plan switch); the job continues on plan B
Every operation writes a ``start`` line before it runs and a ``done`` line after, so an
interrupted transition can be finished (ops already done are skipped) or rolled back.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger

from nereus_core.config import NereusConfig
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.gtg import TransitionInfeasible, build_gtg
from nereus_core.layout import Layout
from storage.journal import ABORT, COMMIT, DONE, START, Journal
from tasks import model_ops
from tasks.device_pool import DevicePool
from tasks.transition_ops import move_stage, relink_copy

HEADS = {"actor": "lm", "reference": "lm", "critic": "value", "reward": "value"}
COPIES = {"actor/generate": "actor/train", "critic/infer": "critic/train"}
OWN_STATE = ("actor/train", "critic/train", "reference/infer", "reward/infer")


def _config(cfg: NereusConfig, stage: str):
    return cfg.model.model_copy(update={"head": HEADS[stage.split("/")[0]]})


def _optimizer(cfg: NereusConfig, stage: str) -> OptimizerSettings | None:
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
) -> dict[str, Any]:
    """Move every model-stage whose layout differs from ``old`` to ``new``; returns the figures."""
    logger = get_run_logger()
    journal = Journal(run_dir, transition_id)
    capacities = {d: int(cfg.cluster.memory_per_device) for d in range(pool.size)}
    models = {s: (_config(cfg, s), s.endswith("/train")) for s in OWN_STATE}
    try:
        # The GTG orders the moves so no device overflows, and routes through the store when it must.
        graph = build_gtg({s: old[s] for s in OWN_STATE}, {s: new[s] for s in OWN_STATE}, models, capacities)
    except TransitionInfeasible as err:
        journal.record("transition", ABORT, step=step, reason=reason, error=str(err))
        logger.warning("transition %s refused before any move: %s", transition_id, err)
        return {"seconds": 0.0, "bytes_moved": 0, "operations": 0, "status": "refused", "error": str(err)}
    journal.record(
        "transition",
        START,
        step=step,
        reason=reason,
        path=path,
        route=graph.route,
        route_reason=graph.reason,
        critical_path_s=graph.critical_path_s,
        old={k: v.model_dump(mode="json") for k, v in old.items()},
        new={k: v.model_dump(mode="json") for k, v in new.items()},
    )
    logger.info(
        "GTG: route %s (%s), %d ops, critical path %.3f s",
        graph.route,
        graph.reason,
        len(graph.ops),
        graph.critical_path_s,
    )
    start = time.perf_counter()
    moved, ops = 0, 0
    try:
        for stage in OWN_STATE:
            if old[stage] == new[stage]:
                continue
            stats = _run_op(
                journal,
                f"move:{stage}",
                move_stage,
                pool,
                stage,
                _config(cfg, stage),
                old[stage],
                new[stage],
                path=path,
                optimizer=_optimizer(cfg, stage),
                run_dir=run_dir,
                step=step,
            )
            moved, ops = moved + stats.get("bytes_moved", 0), ops + 1
            logger.info(
                "moved %s %s -> %s (%s bytes)",
                stage,
                old[stage].key,
                new[stage].key,
                stats.get("bytes_moved"),
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
                _config(cfg, copy),
            )
            moved, ops = moved + stats.get("bytes_moved", 0), ops + 1
    except BaseException as err:
        journal.record("transition", ABORT, error=f"{type(err).__name__}: {err}")
        raise
    seconds = time.perf_counter() - start
    journal.record("transition", COMMIT, seconds=seconds, bytes_moved=moved)
    return {
        "seconds": seconds,
        "bytes_moved": moved,
        "operations": ops,
        "status": "committed",
        "route": graph.route,
        "gtg_critical_path_s": graph.critical_path_s,
    }
