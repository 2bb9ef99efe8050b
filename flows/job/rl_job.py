"""The job flow (PPO or GRPO): what `nereus run` does, read top to bottom.

    open the run (fresh, or resume its newest checkpoint) -> device pool -> load or rehydrate models
    per step:  scenario event? -> controller -> transition subflow -> commit
               a grow to come? -> the pool prepares its workers in the background
               the algorithm's step (flows/job/rl_step.py)
               a phase's stages on disjoint slots (a phased plan) run at once: flows/job/phases.py
               record (flows/job/records.py) -> controller -> transition subflow -> commit
               checkpoint every K steps (a failed one tried once more, then noted in the step's record)
               the newest job.keep_checkpoints complete checkpoints are kept (storage/retention.py)
    final checkpoint -> summary.json

Where things live: the job's state and its rules (what follows a step, when a switch commits,
where to resume) in nereus_core/job.py; a switch in flows/job/switch.py, its transition in
flows/job/transition.py (the GTG's schedule); checkpoints in flows/job/checkpoints.py;
the stages in tasks/step_tasks.py; checkpoints and verification in tasks/job_ops.py.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as prefect_flow_run

from flows.job import checkpoints, engine_switch, generation, rl_step, switch, tracking
from flows.job import growth as job_growth
from flows.job import start as job_start
from flows.job.data import JobData, Prepared, job_data
from flows.job.records import CHECKPOINT_ATTEMPTS, JobRecords, done_line
from flows.job.step_context import StepContext
from nereus_core import job, preflight
from nereus_core.config import NereusConfig
from storage.run_dir import RunDir
from tasks import job_ops, model_ops
from tasks.runtime.device_pool import DevicePool


@flow(name="nereus-ppo")
def rl_job(
    config: NereusConfig | dict[str, Any] | str,
    out_dir: str | None = None,
    devices: int | None = None,
    prepared: Prepared | None = None,
) -> dict[str, Any]:
    """Run PPO or GRPO (``config.algorithm``) for ``config.job.steps`` steps on the device pool; the run
    directory is ``out_dir``; ``prepared``: the job data ``nereus run`` made while checking it (a
    deployment's run, without it, makes it here).

    If ``out_dir`` holds an unfinished run of the same config (a checkpoint, no completed summary:
    the driver died, or this is a retry of the failed flow run; ``out_dir`` defaults to
    ``runs/<name>-<flow run id>``), it resumes from its newest checkpoint instead: an interrupted
    transition is finished or rolled back, and ``devices`` (default: as at the checkpoint) may
    differ, the controller picking the plan for them.
    """
    cfg = job_start.resolve(config)
    tracking.require(cfg.trainer.logger)  # a missing tracker package is refused before anything starts
    out_dir = out_dir or f"runs/{cfg.name}-{str(prefect_flow_run.id)[:8]}"  # a retry finds (resumes) it
    began = time.perf_counter()
    data = job_data(cfg, get_run_logger().info, run_dir=out_dir, prepared=prepared)  # a problem stops here
    with job_start.opened(cfg, out_dir, devices) as (run, resumed_config, point):
        point, grow_to = job.resume_start(point)  # resume on more devices: grow later
        state = job_start.initial_state(run, resumed_config, point)  # the config as it resumes
        with DevicePool.for_cluster(state.config.cluster) as pool:
            ctx = _bring_up(pool, run, state, point, data, grow_to)
            engines_running = engine_switch.engines_of(pool, ctx.state)
            with job_start.quiet_task_logs(), ctx.records.tracking(), engines_running as ctx.engines:
                _validate_before_training(ctx)
                for step in range(point.step if point else 0, ctx.settings.job.steps):
                    _run_step(ctx, step)
            _final_checkpoint(ctx)
        summary = _summary(ctx, time.perf_counter() - began)
        run.write_summary(summary)
    get_run_logger().info(done_line(summary))
    return summary


def _bring_up(
    pool: DevicePool,
    run: RunDir,
    state: job.JobState,
    point: job.ResumePoint | None,
    data: JobData,
    grow_to: int | None,
) -> StepContext:
    """Every model resident on its plan (a grow to come prepared first); the context the loop runs on,
    by the settings as brought up (``state.config``: devices and lengths change there)."""
    if grow_to:
        pool.prepare(grow_to, warm=model_ops.warm_device)
    state, started = job_start.bring_up(pool, run, state, point)
    records = JobRecords(run, first_step=point.step if point else 0, config=state.config)
    return StepContext(
        pool,
        state,
        records,
        data,
        brought_up=state.config,
        growing=job_growth.Growing(target=grow_to),
        point=point,
        started=started,
    )


def _validate_before_training(ctx: StepContext) -> None:
    """A fresh run's validation before its first step, when the config asks for it."""
    validation = ctx.settings.validation
    if ctx.point is None and ctx.data.val is not None and validation and validation.before_train:
        ctx.started["val_before_train"] = generation.validate(
            ctx.pool, ctx.state, ctx.data.val, ctx.rollout_engines
        )


def _run_step(ctx: StepContext, step: int) -> None:
    """One step: an event (and its switch) -> the algorithm's step -> validation -> its record -> the
    controller (and its switch) -> a checkpoint when due."""
    _apply_event(ctx, step)
    ctx.pool.note_memory({}, predicted=preflight.predicted_slot_bytes(ctx.state))  # names a lost worker
    ctx.step = step
    t = time.perf_counter()
    stats, lengths, prompt_lengths = rl_step.run_step(ctx)
    wall = time.perf_counter() - t
    _validate(ctx, stats)  # not in wall
    ctx.records.finish_step(stats, wall, ctx.settings.job.steps)
    checkpoints.finish_in_flight(ctx.pool, ctx.records)  # a switch's recovery point, written meanwhile
    _decide(ctx, lengths, prompt_lengths)
    _checkpoint_when_due(ctx)


def _apply_event(ctx: StepContext, step: int) -> None:
    """Before ``step``: the scenario's event for it, else a grow whose workers are warm; a switch if it
    changed anything."""
    events = [e for e in ctx.state.config.job.scenario if e.step == step]
    event = events[0] if events else ctx.growing.event(ctx.pool, ctx.state, step)
    ctx.state, what = job.apply_event(ctx.state, event)
    if what:
        source = "scenario" if events else "workers ready"
        get_run_logger().info("%s before step %d: %s", source, step, ", ".join(what))
        ctx.state = switch.decide_and_switch(ctx, after=step - 1, why=f" ({', '.join(what)})")


def _validate(ctx: StepContext, stats: dict[str, Any]) -> None:
    """The validation prompts' figures into ``stats`` when validation is due after this step."""
    settings = ctx.settings
    if ctx.data.val is not None and generation.validation_due(
        ctx.step, settings.job.steps, settings.validation
    ):
        stats.update(generation.validate(ctx.pool, ctx.state, ctx.data.val, ctx.rollout_engines))


def _decide(ctx: StepContext, lengths: list[int], prompt_lengths: list[int]) -> None:
    """With ``job.adapt``, before the last step: the controller on what this step showed (its stage
    rows, response and real prompt lengths, memory peaks), and its switch."""
    if ctx.settings.job.adapt and ctx.step + 1 < ctx.settings.job.steps:
        seen = {"rows": ctx.records.step_rows(ctx.step), "memory_peaks": job_ops.held_bytes(ctx.pool)}
        seen |= {"lengths": lengths, "prompt_lengths": prompt_lengths}
        ctx.state = switch.decide_and_switch(ctx, after=ctx.step, **seen)


def _checkpoint_when_due(ctx: StepContext) -> None:
    """Every ``job.snapshot_every`` steps but the last: a checkpoint (retried once), its outcome noted."""
    every, done = ctx.settings.job.snapshot_every, ctx.step + 1
    if every and done % every == 0 and done < ctx.settings.job.steps:
        errors = checkpoints.try_checkpoint(ctx.pool, ctx.state, ctx.records, done)
        ctx.records.checkpoint_outcome(ctx.step, errors, CHECKPOINT_ATTEMPTS)


def _final_checkpoint(ctx: StepContext) -> None:
    """The checkpoint of the last step; JobFailed when it could not be written twice."""
    steps = ctx.settings.job.steps
    if len(checkpoints.try_checkpoint(ctx.pool, ctx.state, ctx.records, steps)) == CHECKPOINT_ATTEMPTS:
        raise job.JobFailed(f"the final checkpoint (step {steps}) could not be written twice")


def _summary(ctx: StepContext, wall: float) -> dict[str, Any]:
    """summary.json: the records' summary, the validation before training, and a resume's figures."""
    summary = ctx.records.summary(ctx.state, wall, ctx.started["fit"])
    if "val_before_train" in ctx.started:
        summary["val_before_train"] = ctx.started["val_before_train"]
    if ctx.point is not None:
        summary.update(
            resumed_from_step=ctx.point.step, resume_verified_bitwise=ctx.started["resume_verified_bitwise"]
        )
    return summary
