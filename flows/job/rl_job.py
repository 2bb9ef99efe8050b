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
the stages in tasks/stages.py; checkpoints and verification in tasks/job_ops.py.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as prefect_flow_run

from flows.job import checkpoints, engine_switch, generation, rl_step, switch, tracking
from flows.job import growth as job_growth
from flows.job import start as job_start
from flows.job.data import job_data
from flows.job.records import CHECKPOINT_ATTEMPTS, JobRecords, done_line
from flows.job.step_context import StepContext
from nereus_core import job, preflight
from nereus_core.config import NereusConfig
from tasks import job_ops, model_ops, rollout_engines
from tasks.runtime.device_pool import DevicePool


@flow(name="nereus-ppo")
def rl_job(
    config: NereusConfig | dict[str, Any] | str, out_dir: str | None = None, devices: int | None = None
) -> dict[str, Any]:
    """Run PPO or GRPO (``config.algorithm``) for ``config.job.steps`` steps on the device pool; the run
    directory is ``out_dir``.

    If ``out_dir`` holds an unfinished run of the same config (a checkpoint, no completed summary:
    the driver died, or this is a retry of the failed flow run; ``out_dir`` defaults to
    ``runs/<name>-<flow run id>``), it resumes from its newest checkpoint instead: an interrupted
    transition is finished or rolled back, and ``devices`` (default: as at the checkpoint) may
    differ, the controller picking the plan for them.
    """
    cfg, logger = job_start.resolve(config), get_run_logger()
    tracking.require(cfg.trainer.logger)  # a missing tracker package is refused before anything starts
    out_dir = out_dir or f"runs/{cfg.name}-{str(prefect_flow_run.id)[:8]}"  # a retry finds (resumes) it
    start = time.perf_counter()
    data = job_data(cfg, logger.info, run_dir=out_dir)  # prompts, tokenizer, reward: a problem stops here
    with job_start.opened(cfg, out_dir, devices) as (run, cfg, point):
        point, grow_to = job.resume_start(point)  # resume on more devices: grow later
        state = job_start.initial_state(run, cfg, point)  # the config as it resumes: state.config
        growing = job_growth.Growing(target=grow_to)
        with DevicePool.for_cluster(state.config.cluster) as pool:
            if grow_to:
                pool.prepare(grow_to, warm=model_ops.warm_device)
            state, started = job_start.bring_up(pool, run, state, point)
            cfg = state.config  # the job's settings from here; devices and lengths change in state.config
            records = JobRecords(run, first_step=point.step if point else 0, config=cfg)
            engines_running = engine_switch.engines_of(pool, state)
            with job_start.quiet_task_logs(), records.tracking(), engines_running as engines:
                ctx = StepContext(pool, state, records, data, engines)
                if point is None and data.val is not None and cfg.validation and cfg.validation.before_train:
                    started["val_before_train"] = generation.validate(pool, state, data.val, _on(engines))
                for step in range(point.step if point else 0, cfg.job.steps):
                    events = [e for e in state.config.job.scenario if e.step == step]
                    event = events[0] if events else growing.event(pool, state, step)  # workers warm: grow
                    state, what = job.apply_event(state, event)
                    if what:
                        source = "scenario" if events else "workers ready"
                        logger.info("%s before step %d: %s", source, step, ", ".join(what))
                        ctx.state = state
                        state = switch.decide_and_switch(ctx, after=step - 1, why=f" ({', '.join(what)})")
                    pool.note_memory(
                        {}, predicted=preflight.predicted_slot_bytes(state)
                    )  # names a lost worker
                    t = time.perf_counter()
                    ctx.state, ctx.step = state, step
                    stats, lengths = rl_step.run_step(ctx)
                    wall = time.perf_counter() - t
                    if data.val is not None and generation.validation_due(
                        step, cfg.job.steps, cfg.validation
                    ):
                        stats.update(generation.validate(pool, state, data.val, _on(engines)))  # not in wall
                    records.finish_step(stats, wall, cfg.job.steps)
                    if cfg.job.adapt and step + 1 < cfg.job.steps:
                        seen = {"rows": records.step_rows(step), "memory_peaks": job_ops.held_bytes(pool)}
                        state = switch.decide_and_switch(ctx, after=step, lengths=lengths, **seen)
                    every = cfg.job.snapshot_every
                    if every and (step + 1) % every == 0 and step + 1 < cfg.job.steps:
                        errors = checkpoints.try_checkpoint(pool, state, records, step + 1)  # retried once
                        records.checkpoint_outcome(step, errors, CHECKPOINT_ATTEMPTS)
            if len(checkpoints.try_checkpoint(pool, state, records, cfg.job.steps)) == CHECKPOINT_ATTEMPTS:
                raise job.JobFailed(f"the final checkpoint (step {cfg.job.steps}) could not be written twice")
        summary = records.summary(state, time.perf_counter() - start, started["fit"])
        if "val_before_train" in started:
            summary["val_before_train"] = started["val_before_train"]
        if point is not None:
            summary.update(
                resumed_from_step=point.step, resume_verified_bitwise=started["resume_verified_bitwise"]
            )
        run.write_summary(summary)
    logger.info(done_line(summary))
    return summary


def _on(engines: engine_switch.JobEngines | None) -> rollout_engines.Engines | None:
    """The vLLM engines in force (None: Nereus's sampler)."""
    return engines.current if engines is not None else None
