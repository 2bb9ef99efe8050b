"""A switch after a step: ask the controller, and carry out what it decides (the transition subflow).

    controller_step (its observation, the decision) -> Keep | Fail | Switch(plan B, priced moves)
    Switch -> plan A read live (digests and probe, when verifying) -> recovery point (plan A at
           step + 1: written, staged for a background write, or none, as ``recovery_write`` says;
           the shards a one-wave live move keeps are written as they are: ``staged_in_place``)
           -> transition_flow (the priced schedule) -> verify the live state against the digests
           read before, rebuild the vLLM engines -> record (every part's seconds) -> commit
    (a switch that failed in live workers and rolled back in memory: recorded, plan A goes on)

Boundary: the controller decides (tasks/controller.py), the transition moves the state
(flows/job/transition.py), the records record (flows/job/records.py); this module orders them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from prefect import get_run_logger
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.utilities.annotations import quote

from flows.job import checkpoints
from flows.job.records import log_decision
from flows.job.step_context import StepContext
from flows.job.transition import transition_flow
from nereus_core import job
from nereus_core.config import recovery_write
from nereus_core.controller.decide import Decision, TransitionTiming
from nereus_core.controller.transition_schedule import has_durable_units, staged_in_place
from nereus_core.cost.transition_cost import engines_rebuilt
from storage.journal import journals
from tasks import job_ops
from tasks.controller import controller_step
from tasks.probes import run_probes


@dataclass(frozen=True)
class PlanARead:
    """Plan A as the devices held it before anything moved: every model's live digest and the probe's
    outputs (when the job verifies), and the vLLM engines' probe (when the switch rebuilds them)."""

    digests: dict[str, str] | None
    probe: Any
    engines: Any


def decide_and_switch(ctx: StepContext, *, after: int, why: str = "", **seen: Any) -> job.JobState:
    """Ask the controller after step ``after`` (``seen``: the step's rows, measured lengths and memory
    peaks); carry out the switch it admits or forces; return the state in force next."""
    # Quoted, as the schedule below: Prefect would walk the controller's whole memory (its plan
    # records, samples and stage timings) before the task ran: 0.48 s a call after 1,000 steps.
    outcome, decision, state = controller_step(
        quote(ctx.state),  # type: ignore[arg-type]
        step=after,
        ready_devices=ctx.pool.ready_devices,
        **seen,
    )
    log_decision(decision, after)
    if decision.probes:  # timed now, seen by the next decision
        state = _probe(ctx, state, decision, after)
    if isinstance(outcome, job.Fail):
        raise job.JobFailed(f"after step {after}{why}: {outcome.reason}")
    if isinstance(outcome, job.Keep):
        return state
    transition_id = _new_transition_id(ctx, after)
    began = time.perf_counter()
    resize = outcome.devices != state.devices
    mode = recovery_write(
        state.config.job.switch_recovery, durable=has_durable_units(outcome.moves, resize=resize)
    )
    stats: dict[str, Any] = {"recovery": mode}
    plan_a = _read_plan_a(ctx, state, outcome, stats)
    in_place = staged_in_place(outcome.moves, mode, resize=resize)
    stats["staged_in_place"] = ",".join(sorted(in_place))
    if not _recovery_point(
        ctx, state, outcome, transition_id, stats, step=after, digests=plan_a.digests, in_place=in_place
    ):
        return job.commit(state, outcome, "aborted")
    status = "failed"
    try:
        checkpoint_step = None if mode == "none" else after + 1
        stats.update(
            _transition(ctx, state, outcome, transition_id, step=after, checkpoint_step=checkpoint_step)
        )
        stats["moves_s"] = stats["seconds"]
        status = stats["status"] if stats["status"] in ("refused", "rolled_back") else "committed"
        if in_place and status == "refused":  # plan A trains the shards written in place: finish first
            checkpoints.finish_in_flight(ctx.pool, ctx.records)
        if status == "rolled_back":
            stats["note"] = f"failed in live workers, rolled back in memory: {stats['error']}"
        if status == "committed":
            _check_and_rebuild(ctx, outcome, transition_id, stats, plan_a)
    finally:
        stats["seconds"] = time.perf_counter() - began  # the decision to the next step: what is priced
        ctx.records.transition(transition_id, after, state, outcome, stats, status)
    _log_transition(transition_id, status, state, outcome, stats)
    kept = "aborted" if status == "rolled_back" else status  # rolled back in memory: plan A goes on
    return job.commit(state, outcome, kept, _timing(decision, status, stats))  # type: ignore[arg-type]


def _probe(ctx: StepContext, state: job.JobState, decision: Decision, after: int) -> job.JobState:
    """The probes ``decision`` asked for, run on the pool in force and noted in step ``after``'s
    history line; the state carries their timings to the next decision."""
    start = time.perf_counter()
    timings = run_probes(ctx.pool, state.config, decision.probes)
    ctx.records.probes_ran(after, timings, time.perf_counter() - start)
    return replace(state, probes=timings)


def _new_transition_id(ctx: StepContext, after: int) -> str:
    """``t<n>-step<after>``, n counting every switch the run has journaled: a switch run again after a
    resume rolled its first attempt back (``async``, ``none``) gets a journal of its own, not the one
    whose units the dead driver marked done."""
    made = [j for j in journals(ctx.records.run.root) if j.transition_id[:1] == "t"]
    return f"t{max(len(ctx.records.transitions), len(made)):03d}-step{after}"


def _recovery_point(
    ctx: StepContext,
    state: job.JobState,
    switch: job.Switch,
    transition_id: str,
    stats: dict,
    *,
    step: int,
    digests: dict[str, str] | None,
    in_place: frozenset[str],
) -> bool:
    """Plan A's state at ``step`` + 1 as ``stats["recovery"]`` says: written before anything moves
    (``sync``), staged in host memory and written in the background (``async``; ``in_place``: the
    model-stages the moves keep, written from their shards with no copy), or nothing (``none``);
    False (the switch recorded as aborted, plan A stays) when it could not be written or staged.
    ``digests``: every model's live digest, read just before (the checkpoint record's)."""
    mode, start = stats["recovery"], time.perf_counter()
    if mode == "none":
        stats["recovery_s"] = stats["checkpoint_s"] = 0.0
        return True
    try:
        if mode == "sync":
            with job_ops.disk_filled_if_armed(str(ctx.records.run.root)):
                checkpoints.checkpoint(ctx.pool, state, ctx.records, step + 1, digests)
        else:
            checkpoints.stage(ctx.pool, state, ctx.records, step + 1, digests, in_place)
    except Exception as err:
        get_run_logger().error("switch aborted, plan A stays: the checkpoint could not be written: %s", err)
        stats["note"] = "aborted: the checkpoint could not be written"
        ctx.records.transition(transition_id, step, state, switch, stats, "aborted")
        return False
    stats["recovery_s"] = stats["checkpoint_s"] = time.perf_counter() - start
    return True


def _read_plan_a(ctx: StepContext, state: job.JobState, switch: job.Switch, stats: dict) -> PlanARead:
    """What plan A holds and answers before anything moves (``PlanARead``); its seconds are the
    verification's (``stats["verify_s"]``)."""
    pool, cfg, engines = ctx.pool, state.config, ctx.engines
    start = time.perf_counter()
    digests = probe = None
    if cfg.job.verify_transitions:
        digests = job_ops.live_digests(pool, cfg, state.layouts)
        probe = job_ops.probe(pool, cfg, state.layouts)
    stats["verify_s"] = time.perf_counter() - start
    rebuild = engines is not None and engines_rebuilt(
        state.layouts, switch.layouts, resize=switch.devices != state.devices
    )
    return PlanARead(digests, probe, engines.probe() if rebuild and engines is not None else None)


def _transition(
    ctx: StepContext,
    state: job.JobState,
    switch: job.Switch,
    transition_id: str,
    *,
    step: int,
    checkpoint_step: int | None,
) -> dict[str, Any]:
    """The transition subflow on the schedule the controller priced (``switch.moves``);
    ``checkpoint_step``: where plan A's state is (or is being) written, None when nowhere.

    The schedule is handed over ``quote``d: Prefect walks a flow's parameters for futures before
    the flow runs, and the schedule's transition graph holds every op of the move: for an 8B PPO
    switch on 16 GPUs (55,938 ops) the subflow's call took 61.5 s bare, 1.2 s quoted
    (benchmarks/bench_prefect_parameters.py).

    The subflow sends no heartbeats of its own: Prefect's heartbeat thread sleeps in one-second
    slices and the flow run waits for it to end, up to a second added to every switch (an empty
    subflow took 1.3 s with heartbeats, 0.33 s without). The job's flow run, in the same process,
    keeps sending them: a driver that dies mid-switch stops those, and the job's run is marked
    Crashed (prefect-automations.yaml); its Retry resumes the switch from the journal."""
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        return transition_flow(
            ctx.pool,
            state.config,
            str(ctx.records.run.root),
            transition_id,
            state.plan,
            switch.plan,
            step=step,
            reason=switch.reason,
            moves=quote(switch.moves),  # type: ignore[arg-type]
            checkpoint_step=checkpoint_step,
            devices=switch.devices,
        )


def _check_and_rebuild(
    ctx: StepContext, switch: job.Switch, transition_id: str, stats: dict, plan_a: PlanARead
) -> None:
    """After a committed move: the live state checked against plan A's live digests, read before
    the moves, and actor/generate's vLLM engines rebuilt on plan B when its layout changed."""
    cfg = ctx.state.config
    if plan_a.digests is not None:
        start, what = time.perf_counter(), f"switch {transition_id}"
        stats.update(
            job_ops.verify_live_state(
                ctx.pool, cfg, switch.layouts, plan_a.digests, what=what, probe_before=plan_a.probe
            )
        )
        stats["verify_s"] += time.perf_counter() - start
    if ctx.engines is not None and plan_a.engines is not None:
        stats.update(ctx.engines.rebuild(switch.layouts, plan_a.engines))


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
