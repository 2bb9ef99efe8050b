"""A switch after a step: ask the controller, and carry out what it decides (the transition subflow).

    controller_step (its observation, the decision) -> Keep | Fail | Switch(plan B, priced moves)
    Switch -> recovery point (plan A at step + 1) -> transition_flow (the priced schedule)
           -> verify the live state, rebuild the vLLM engines -> record -> commit

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
from nereus_core.controller.decide import Decision, TransitionTiming
from nereus_core.cost.transition_cost import engines_rebuilt
from tasks import job_ops
from tasks.controller import controller_step


def decide_and_switch(ctx: StepContext, *, after: int, why: str = "", **seen: Any) -> job.JobState:
    """Ask the controller after step ``after`` (``seen``: the step's rows, measured lengths and memory
    peaks); carry out the switch it admits or forces; return the state in force next."""
    outcome, decision, state = controller_step(
        ctx.state, step=after, ready_devices=ctx.pool.ready_devices, **seen
    )
    log_decision(decision, after)
    if isinstance(outcome, job.Fail):
        raise job.JobFailed(f"after step {after}{why}: {outcome.reason}")
    if isinstance(outcome, job.Keep):
        return state
    transition_id = f"t{len(ctx.records.transitions):03d}-step{after}"
    stats: dict[str, Any] = {}
    if not _recovery_point(ctx, state, outcome, transition_id, stats, step=after):
        return job.commit(state, outcome, "aborted")
    probes = _probes_before(ctx, state, outcome)
    status = "failed"
    try:
        stats.update(_transition(ctx, state, outcome, transition_id, step=after))
        status = "refused" if stats["status"] == "refused" else "committed"
        if status == "committed":
            _check_and_rebuild(ctx, outcome, transition_id, stats, probes, step=after)
    finally:
        ctx.records.transition(transition_id, after, state, outcome, stats, status)
    _log_transition(transition_id, status, state, outcome, stats)
    return job.commit(state, outcome, status, _timing(decision, status, stats))  # type: ignore[arg-type]


def _recovery_point(
    ctx: StepContext, state: job.JobState, switch: job.Switch, transition_id: str, stats: dict, *, step: int
) -> bool:
    """Plan A's state at ``step`` + 1, written before anything moves; False (the switch recorded as
    aborted, plan A stays) when it could not be written."""
    try:
        with job_ops.disk_filled_if_armed(str(ctx.records.run.root)):
            stats["checkpoint_s"] = checkpoint(ctx.pool, state, ctx.records, step + 1)
    except Exception as err:
        get_run_logger().error("switch aborted, plan A stays: the checkpoint could not be written: %s", err)
        stats["note"] = "aborted: the checkpoint could not be written"
        ctx.records.transition(transition_id, step, state, switch, stats, "aborted")
        return False
    return True


def _probes_before(ctx: StepContext, state: job.JobState, switch: job.Switch) -> tuple[Any, Any]:
    """What plan A answers before anything moves: the live state's probe (``verify_transitions``)
    and actor/generate's vLLM engines' when the switch rebuilds them (None where not wanted)."""
    pool, cfg, engines = ctx.pool, state.config, ctx.engines
    before = job_ops.probe(pool, cfg, state.layouts) if cfg.job.verify_transitions else None
    rebuild = engines is not None and engines_rebuilt(
        state.layouts, switch.layouts, resize=switch.devices != state.devices
    )
    return before, engines.probe() if rebuild and engines is not None else None


def _transition(
    ctx: StepContext, state: job.JobState, switch: job.Switch, transition_id: str, *, step: int
) -> dict[str, Any]:
    """The transition subflow on the schedule the controller priced (``switch.moves``)."""
    return transition_flow(
        ctx.pool,
        state.config,
        str(ctx.records.run.root),
        transition_id,
        state.plan,
        switch.plan,
        step=step,
        reason=switch.reason,
        moves=switch.moves,
        checkpoint_step=step + 1,
        devices=switch.devices,
    )


def _check_and_rebuild(
    ctx: StepContext,
    switch: job.Switch,
    transition_id: str,
    stats: dict,
    probes: tuple[Any, Any],
    *,
    step: int,
) -> None:
    """After a committed move: the live state checked against the recovery point's digests, and
    actor/generate's vLLM engines rebuilt on plan B when its layout changed (``ctx.engines``)."""
    before, engines_before = probes
    cfg = ctx.state.config
    if cfg.job.verify_transitions:
        expected = ctx.records.run.read_checkpoint(step + 1)["live_digests"]
        what = f"switch {transition_id}"
        stats.update(
            job_ops.verify_live_state(ctx.pool, cfg, switch.layouts, expected, what=what, probe_before=before)
        )
    if ctx.engines is not None and engines_before is not None:
        stats.update(ctx.engines.rebuild(switch.layouts, engines_before))
        stats["seconds"] += stats["engine_rebuild_s"]  # what calibration compares with the prediction


def _timing(decision: Decision, status: str, stats: dict) -> TransitionTiming | None:
    """The committed transition's prediction and its measured time, for calibration (live and
    durable alike); None when nothing ran."""
    if status != "committed" or decision.transition is None:
        return None
    return TransitionTiming(predicted=decision.transition, seconds=max(stats["seconds"], 1e-6))


def _log_transition(
    transition_id: str, status: str, state: job.JobState, switch: job.Switch, stats: dict
) -> None:
    get_run_logger().info(
        "transition %s %s (%s route): %s -> %s in %.2f s, %d bytes moved; %s",
        transition_id,
        status,
        stats.get("route"),
        state.plan_id,
        switch.plan_id,
        stats.get("seconds", 0.0),
        stats.get("bytes_moved", 0),
        switch.reason,
    )
