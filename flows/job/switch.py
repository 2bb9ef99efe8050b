"""A switch after a step: ask the controller, and carry out what it decides (the transition subflow).

Boundary: the controller decides (tasks/controller.py), the transition moves the state
(flows/job/transition.py), the records record (flows/job/records.py); this module orders them.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger

from flows.job.checkpoints import checkpoint
from flows.job.records import log_decision
from flows.job.step_context import StepContext
from flows.job.transition import transition_flow
from nereus_core import job
from nereus_core.controller.decide import TransitionTiming
from nereus_core.cost.transition_cost import engines_rebuilt
from tasks import job_ops
from tasks.controller import controller_step


def decide_and_switch(ctx: StepContext, *, after: int, why: str = "", **seen: Any) -> job.JobState:
    """Ask the controller after step ``after`` (``seen``: the step's rows and measured lengths); carry
    out the switch it admits or forces (``ctx.engines``: actor/generate's vLLM engines, rebuilt when
    the switch changes its layout); return the state in force next."""
    pool, state, records, step, engines = ctx.pool, ctx.state, ctx.records, after, ctx.engines
    obs = job.observation(state, step=step, ready_devices=pool.ready_devices, **seen)
    outcome, decision, state = controller_step(state, obs)
    log_decision(decision, step)
    if isinstance(outcome, job.Fail):
        raise job.JobFailed(f"after step {step}{why}: {outcome.reason}")
    if isinstance(outcome, job.Keep):
        return state
    transition_id = f"t{len(records.transitions):03d}-step{step}"
    stats: dict[str, Any] = {}
    try:
        # Plan A's state at step + 1 is a recovery point before anything moves.
        with job_ops.disk_filled_if_armed(str(records.run.root)):
            stats["checkpoint_s"] = checkpoint(pool, state, records, step + 1)
    except Exception as err:
        get_run_logger().error("switch aborted, plan A stays: the checkpoint could not be written: %s", err)
        stats["note"] = "aborted: the checkpoint could not be written"
        records.transition(transition_id, step, state, outcome, stats, "aborted")
        return job.commit(state, outcome, "aborted")
    verify = state.config.job.verify_transitions
    before = job_ops.probe(pool, state.config, state.layouts) if verify else None
    rebuild = engines is not None and engines_rebuilt(
        state.layouts, outcome.layouts, resize=outcome.devices != state.devices
    )
    engines_before = engines.probe() if rebuild and engines is not None else None
    status = "failed"
    try:
        stats.update(
            transition_flow(
                pool,
                state.config,
                str(records.run.root),
                transition_id,
                dict(state.layouts),
                dict(outcome.layouts),
                step=step,
                reason=outcome.reason,
                checkpoint_step=step + 1,
                devices=outcome.devices,
            )
        )
        status = "refused" if stats["status"] == "refused" else "committed"
        if status == "committed" and verify:
            expected = records.run.read_checkpoint(step + 1)["live_digests"]
            stats.update(
                job_ops.verify_live_state(
                    pool,
                    state.config,
                    outcome.layouts,
                    expected,
                    what=f"switch {transition_id}",
                    probe_before=before,
                )
            )
        if status == "committed" and engines is not None and engines_before is not None:
            stats.update(engines.rebuild(outcome.layouts, engines_before))
            stats["seconds"] += stats["engine_rebuild_s"]  # what calibration compares with the prediction
    finally:
        records.transition(transition_id, step, state, outcome, stats, status)
    ran = status == "committed" and decision.transition is not None  # live and durable calibrate alike
    timing = (
        TransitionTiming(predicted=decision.transition, seconds=max(stats["seconds"], 1e-6)) if ran else None
    )
    get_run_logger().info(
        "transition %s %s (%s route): %s -> %s in %.2f s, %d bytes moved; %s",
        transition_id,
        status,
        stats.get("route"),
        state.plan_id,
        outcome.plan_id,
        stats.get("seconds", 0.0),
        stats.get("bytes_moved", 0),
        outcome.reason,
    )
    return job.commit(state, outcome, status, timing)  # type: ignore[arg-type]
