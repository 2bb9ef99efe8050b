"""The transition subflow: switch the running job from plan A to plan B, journaled.

    the controller's priced schedule (``Switch.moves``), its pool re-checked against the live one:
      changed -> journal: abort, the switch refused in one line, plan A stays (never re-planned)
    journal: transition start (plans, reason, route, the executed schedule, the checkpoint)
      same devices: the GTG (nereus_core.gtg) orders the ops so no device overflows; the executor
        runs them grouped into units (nereus_core.gtg.execution), wave by wave, after replaying
        that very order against the devices' capacities:
          move:<stage>    live reshard of parameters + AdamW state (slices device to device)
          unload:<stage>  a durable stage drops its old shards (its state is in the checkpoint)
          load:<stage>    ... and is rehydrated on its new layout from the checkpoint
        no memory-safe order of whole units: every changed stage goes durable instead
        one wave of live moves: the old shards are kept until the end; a failure in live workers
        rolls the switch back in memory (flows/job/rollback.py; journal: abort, plan A goes on)
      another device set: drop every shard -> resize the pool (a new world) -> rehydrate every
        model-stage under plan B from the checkpoint (flows/job/rehydration.py)
      -> inference copies of trained models (actor/generate, critic/infer): relink
      -> journal: commit (the plan switch); the job continues on plan B
      -> workers a shrink let go retire (``DevicePool.retire_left``): plan B no longer uses them
Every unit writes a ``start`` line before it runs and a ``done`` line after, so after a crash the
journal says how far it got; ``nereus resume`` then finishes the switch from the checkpoint
(plan B) or rolls it back (plan A): nereus_core.job.resume_point.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from prefect import flow, get_run_logger

from flows.job import rollback
from flows.job.rehydration import rehydrate_all, rehydrate_stage, relink, run_op
from nereus_core import faults
from nereus_core.config import NereusConfig, engine_kv_bytes
from nereus_core.controller.moves import MoveBasis, MoveSchedule, Planned
from nereus_core.controller.transition_schedule import plan_moves
from nereus_core.gtg import TransitionGraph, TransitionInfeasible
from nereus_core.gtg.execution import NoStageSchedule, StageSchedule
from nereus_core.job import model_config, optimizer_settings
from nereus_core.plan import GlobalPlan, StageLayouts, copies
from storage.journal import ABORT, COMMIT, DONE, START, Journal
from tasks import model_ops
from tasks.runtime.device_pool import DevicePool
from tasks.transition_ops import move_stage, move_stages, release_kept


def live_basis(pool: DevicePool, cfg: NereusConfig, devices: int | None = None) -> MoveBasis:
    """The pool a switch's moves would run on now: its slots (the larger world while it resizes to
    ``devices``), the config's memory per slot and the KV cache plan A's vLLM engines hold."""
    slots = max(pool.size, pool.size if devices is None else devices)
    memory = int(cfg.cluster.memory_per_device)
    return MoveBasis(slots=slots, memory_per_device=memory, engine_kv_bytes=engine_kv_bytes(cfg))


def _planned(
    pool: DevicePool,
    cfg: NereusConfig,
    old: GlobalPlan,
    new: GlobalPlan,
    moves: MoveSchedule | None,
    *,
    target: int,
    step: int,
) -> Planned | str:
    """The GTG and schedule to run, or the one line that refuses the switch before any move.

    On the same devices: the schedule the controller priced (``moves``), after its basis is checked
    against the live pool; it is never planned again here. A new world is the durable path: the
    controller priced it as every stage rehydrated and carries no schedule, so the durable GTG is
    planned here for the journal's schedule and the memory check of plan B."""
    if target != pool.size:
        caps = live_basis(pool, cfg, target).capacities(old.layouts, cfg.models)
        try:
            planned = plan_moves(old.layouts, new.layouts, cfg.models, caps, live=False)
        except (TransitionInfeasible, NoStageSchedule) as err:
            return str(err)
        why = f"the device set changes ({pool.size} -> {target} slots): the world is rebuilt"
        return Planned(planned.graph, planned.schedule, why)
    if moves is None:
        raise ValueError(
            "a switch on the same devices runs the schedule the controller priced: give moves "
            "(transition_schedule.schedule_moves)"
        )
    if moves.old != old or moves.new != new:
        raise ValueError(
            f"the moves were priced for {moves.old.plan_id} -> {moves.new.plan_id}, not "
            f"{old.plan_id} -> {new.plan_id}; give this switch's schedule"
        )
    changed = moves.changed(live_basis(pool, cfg))
    if changed:
        return f"{changed}: the controller decides again after step {step + 1}"
    return moves.planned if moves.planned is not None else moves.refused


@flow(name="nereus-transition", validate_parameters=False)
def transition_flow(
    pool: DevicePool,
    cfg: NereusConfig,
    run_dir: str,
    transition_id: str,
    old: GlobalPlan,
    new: GlobalPlan,
    *,
    step: int,
    reason: str,
    moves: MoveSchedule | None = None,
    path: str = "live",
    checkpoint_step: int | None = None,
    devices: int | None = None,
) -> dict[str, Any]:
    """Move every model-stage whose layout differs from ``old`` to ``new``; returns the figures.

    ``moves``: the schedule the controller priced (``Switch.moves``; needed on the same devices).
    ``checkpoint_step``: plan A's state of every model is committed at this step in the run directory:
    durable units rehydrate from it, ``nereus resume`` finishes an interrupted switch from it.
    ``devices``: the pool's size under plan B (a change rebuilds the world). ``path``: live units'.
    """
    logger = get_run_logger()
    journal = Journal(run_dir, transition_id)
    target = pool.size if devices is None else devices
    resize = target != pool.size
    if resize and checkpoint_step is None:
        raise ValueError("changing the device set rebuilds the world: give checkpoint_step")
    planned = _planned(pool, cfg, old, new, moves, target=target, step=step)
    if isinstance(planned, str):
        journal.record("transition", ABORT, step=step, reason=reason, error=planned)
        logger.warning("transition %s refused before any move: %s", transition_id, planned)
        return {"seconds": 0.0, "bytes_moved": 0, "operations": 0, "status": "refused", "error": planned}
    route = "durable" if resize else planned.graph.route
    _announce(journal, planned, route, old, new, step, reason, path, checkpoint_step, (pool.size, target))
    start, kept = time.perf_counter(), not resize and rollback.keeps_old(planned.schedule, path)
    try:
        args = (pool, cfg, run_dir, journal, planned, old, new, path, step, checkpoint_step)
        moved, units = _carry_out(*args, target=target)
    except BaseException as err:
        undone = rollback.undo(pool, cfg, journal, old, err) if kept else None
        if undone is None:
            journal.record("transition", ABORT, error=f"{type(err).__name__}: {err}"[:500])
            raise
        return {**undone, "seconds": time.perf_counter() - start, "route": route}
    seconds = time.perf_counter() - start
    if kept:
        release_kept(pool)  # committed: the old shards kept for a rollback go
    journal.record("transition", COMMIT, seconds=seconds, bytes_moved=moved)
    retire_s = pool.retire_left()  # workers plan B does not use leave once it is in force
    return {
        "seconds": seconds,
        "retire_s": retire_s,
        "bytes_moved": moved,
        "operations": units,
        "status": "committed",
        "route": route,
        "gtg_critical_path_s": planned.graph.critical_path_s,
        "peak_bytes": max(planned.schedule.peak_bytes.values(), default=0),
    }


def _carry_out(
    pool: DevicePool,
    cfg: NereusConfig,
    run_dir: str,
    journal: Journal,
    planned: Planned,
    old: GlobalPlan,
    new: GlobalPlan,
    path: str,
    step: int,
    checkpoint_step: int | None,
    *,
    target: int,
) -> tuple[int, int]:
    """The switch's moves: onto ``target`` slots by rehydration when the device set changes, else
    the schedule on the same devices; returns the bytes moved and the units run."""
    if target != pool.size:
        moved = rehydrate_all(pool, cfg, run_dir, journal, new, checkpoint_step, target)  # type: ignore[arg-type]
        return moved, len(new.layouts)
    return _same_world(pool, cfg, run_dir, journal, planned, old, new, path, step, checkpoint_step)


def _announce(
    journal: Journal,
    planned: Planned,
    route: str,
    old: GlobalPlan,
    new: GlobalPlan,
    step: int,
    reason: str,
    path: str,
    checkpoint_step: int | None,
    devices: tuple[int, int],
) -> None:
    """The journal's start line: the plans, the route and the schedule about to run (what ``nereus
    resume`` reads to finish or roll back the switch); ``devices``: the pool's size before and after."""
    graph, schedule = planned.graph, planned.schedule
    if schedule.waves and any(u.startswith("load:") for u in schedule.order) and checkpoint_step is None:
        raise ValueError(f"{planned.reason}: durable units rehydrate from a checkpoint; give checkpoint_step")
    journal.record(
        "transition",
        START,
        step=step,
        reason=reason,
        path=path,
        route=route,
        route_reason=planned.reason,
        critical_path_s=graph.critical_path_s,
        schedule=[list(w) for w in schedule.waves],
        checkpoint_step=checkpoint_step,
        devices_before=devices[0],
        devices=devices[1],
        old=old.as_json(),
        new=new.as_json(),
    )
    get_run_logger().info(
        "GTG: route %s (%s), %d ops in %d units", route, planned.reason, len(graph.ops), len(schedule.order)
    )


def _same_world(
    pool: DevicePool,
    cfg: NereusConfig,
    run_dir: str,
    journal: Journal,
    planned: Planned,
    old: GlobalPlan,
    new: GlobalPlan,
    path: str,
    step: int,
    checkpoint_step: int | None,
) -> tuple[int, int]:
    """Run the schedule's units, then unload and relink every inference copy whose layout or source
    changed; returns the bytes moved and the units run."""
    a, b = old.layouts, new.layouts
    args = (pool, cfg, run_dir, journal, planned.graph, planned.schedule, a, b, path, step, checkpoint_step)
    moved = _run_schedule(*args)
    changed = [c for c, s in copies(b).items() if a[c] != b[c] or a[s] != b[s]]
    if changed and faults.armed("kill-driver:move"):  # every unit ran in one wave: die before relinks
        get_run_logger().warning("fault injection: the driver dies with the copies still to relink")
        os.kill(os.getpid(), signal.SIGKILL)
    for copy in changed:
        model_ops.unload_model(pool, a[copy], name=copy)
    moved += relink(pool, cfg, journal, b, changed)
    return moved, len(planned.schedule.order) + len(changed)


def _run_schedule(
    pool: DevicePool,
    cfg: NereusConfig,
    run_dir: str,
    journal: Journal,
    graph: TransitionGraph,
    schedule: StageSchedule,
    old: StageLayouts,
    new: StageLayouts,
    path: str,
    step: int,
    checkpoint_step: int | None,
) -> int:
    """Run the schedule's units wave by wave. A wave's live moves run at once: one device call per
    device carries its part of every one of them (``move_stages``: the collectives in one order on
    every device, each move's messages under its own tags); the wave's other units (durable
    unloads and loads, or moves on the durable path) then run one after another. Safe for memory in
    any order: the replay that proved the schedule counts all of a wave's allocations before any of
    its frees."""
    logger, moved, done, keep = get_run_logger(), 0, 0, rollback.keeps_old(schedule, path)
    for wave in schedule.waves:
        finished = journal.done_ops()
        together = [u for u in wave if u.startswith("move:") and u not in finished] if path == "live" else []
        batches = [together] if len(together) > 1 else []
        batches += [[u] for u in wave if len(together) < 2 or u not in together]
        for units in batches:
            if len(units) > 1:
                results = _run_moves_together(pool, cfg, journal, units, old, new, keep)
            else:
                args = (units[0], old, new, path, step, checkpoint_step)
                results = [(units[0], _run_unit(pool, cfg, run_dir, journal, *args, keep=keep))]
            for unit, stats in results:
                stage = unit.partition(":")[2]
                moved, done = moved + stats.get("bytes_moved", 0), done + 1
                logger.info(
                    "%s %s -> %s (%s bytes)", unit, old[stage].key, new[stage].key, stats.get("bytes_moved")
                )
            if done < len(schedule.order) and faults.armed("kill-driver:move"):
                logger.warning("fault injection: the driver dies after %s, with units still to run", units)
                os.kill(os.getpid(), signal.SIGKILL)
    return moved


def _run_moves_together(
    pool: DevicePool,
    cfg: NereusConfig,
    journal: Journal,
    units: list[str],
    old: StageLayouts,
    new: StageLayouts,
    keep: bool,
) -> list[tuple[str, dict[str, Any]]]:
    """A wave's live moves in one call; each unit journaled (start before, done after) on its own;
    ``keep``: the devices keep the old shards for a rollback (``flows.job.rollback``)."""
    stages = [u.partition(":")[2] for u in units]
    for unit in units:
        journal.record(unit, START)
    moves = [(s, model_config(cfg, s), old[s], new[s], optimizer_settings(cfg, s)) for s in stages]
    results = move_stages(pool, moves, keep_old=keep)
    for unit, stats in zip(units, results, strict=True):
        journal.record(unit, DONE, seconds=stats["seconds"], bytes_moved=stats["bytes_moved"], together=units)
    return list(zip(units, results, strict=True))


def _run_unit(
    pool: DevicePool,
    cfg: NereusConfig,
    run_dir: str,
    journal: Journal,
    unit: str,
    old: StageLayouts,
    new: StageLayouts,
    path: str,
    step: int,
    checkpoint_step: int | None,
    *,
    keep: bool = False,
) -> dict[str, Any]:
    kind, _, stage = unit.partition(":")
    if kind == "move":
        return run_op(
            journal,
            unit,
            move_stage,
            pool,
            stage,
            model_config(cfg, stage),
            old[stage],
            new[stage],
            path=path,
            optimizer=optimizer_settings(cfg, stage),
            run_dir=run_dir,
            step=step,
            keep_old=keep,
        )
    if kind == "unload":
        return run_op(journal, unit, model_ops.unload_model, pool, old[stage], name=stage)
    return run_op(journal, unit, rehydrate_stage, pool, cfg, run_dir, checkpoint_step, stage, new[stage])
