"""The job flow (PPO or GRPO): what `nereus run` does, read top to bottom.

    open the run (fresh, or resume its newest checkpoint) -> device pool -> load or rehydrate models
    per step:  scenario event? -> controller -> transition subflow -> commit
               a grow to come? -> the pool prepares its workers in the background
               the algorithm's step (STEPS): PPO's here, GRPO's in flows/job/grpo_step.py
               PPO step: actor/generate -> experience (reward, reference, old log-probs, values)
                         -> advantages -> actor/train (+ sync), critic/train (+ sync) -> rollout
               a phase's stages on disjoint slots (a phased plan) run at once: flows/job/phases.py
               record (flows/job/records.py) -> controller -> transition subflow -> commit
               checkpoint every K steps (a failed one tried once more, then noted in the step's record)
               the newest job.keep_checkpoints complete checkpoints are kept (storage/retention.py)
    final checkpoint -> summary.json

Where things live: the job's state and its rules (what follows a step, when a switch commits,
where to resume) in nereus_core/job.py; a transition in flows/job/transition.py (the GTG's schedule);
the stages in tasks/stages.py; checkpoints and verification in tasks/job_ops.py.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as prefect_flow_run

from flows.job import engine_switch, generation, grpo_step, step_parts, tracking
from flows.job import growth as job_growth
from flows.job import start as job_start
from flows.job.data import job_data
from flows.job.records import CHECKPOINT_ATTEMPTS, JobRecords, done_line, log_decision
from flows.job.transition import transition_flow
from nereus_core import job, preflight
from nereus_core.config import NereusConfig
from nereus_core.controller.decide import TransitionTiming
from nereus_core.cost.transition_cost import engines_rebuilt
from nereus_core.plan import ModelStage, state_stages
from nereus_core.prompt_source import PromptSource
from nereus_core.rl import rollout
from storage import retention
from tasks import job_ops, model_ops, rollout_engines, stages
from tasks.controller import controller_step
from tasks.runtime.device_pool import DevicePool

PASSES = ("reward/infer", "reference/infer", "actor/train", "critic/infer")  # forward passes over the rollout
TRAINS = (ModelStage.ACTOR_TRAIN, ModelStage.CRITIC_TRAIN)  # the train stages, each with its sync


def run_step(
    pool: DevicePool,
    state: job.JobState,
    records: JobRecords,
    step: int,
    prompt_source: PromptSource | None = None,
    *,
    engines: rollout_engines.Engines | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """One PPO step on the plan in force; returns its statistics (scores, losses, PPO statistics,
    response lengths) and every generated response's length. ``prompt_source``: the prompts, stop ids and
    rule (flows/job/data.py; default: the count task); ``engines``: actor/generate's vLLM engines."""
    cfg, plan, pid = state.config, state.layouts, state.plan_id
    b, t_len = cfg.job.batch_size, cfg.job.response_len
    source = prompt_source or job_data(cfg).train
    r, scores = generation.rollout(pool, state, records, step, source, engines=engines)
    # reward/infer runs only when the job scores with a reward model (the plan has it)
    out = step_parts.forward_passes(pool, state, records, step, r, PASSES)
    r.score = (
        rollout.final_score(out["reward/infer"], r.attention_mask) if "reward/infer" in out else r.rule_score
    )
    r.ref_logp = rollout.response_logp(out["reference/infer"], t_len)
    r.old_logp = rollout.response_logp(out["actor/train"], t_len)
    r.values = rollout.response_values(out["critic/infer"], t_len)
    with records.plain(step, pid, "ppo", "advantages", b * t_len):
        rollout.compute_advantages(r, cfg.ppo)
    objectives = {s: stages.ppo_objective(cfg.ppo, critic=s.model == "critic") for s in TRAINS if s in plan}
    trained = step_parts.train_stages(pool, state, records, step, r, objectives)
    step_parts.sync_engines(pool, state, records, step, engines)
    step_parts.write_rollout(records, state, step, r, scores)
    stats = step_parts.step_stats(state, step, r, scores, {m: trained[m] for m in ("actor", "critic")})
    return stats, r.lengths.tolist()


# The step of each algorithm (``algorithm.name``); the rest of the flow is the same for both.
STEPS = {"ppo": run_step, "grpo": grpo_step.run_step}


def decide_and_switch(
    pool: DevicePool,
    state: job.JobState,
    records: JobRecords,
    step: int,
    *,
    why: str = "",
    engines: engine_switch.JobEngines | None = None,
    **seen: Any,
) -> job.JobState:
    """Ask the controller after ``step`` (``seen``: the step's rows and measured lengths); carry out
    the switch it admits or forces (``engines``: actor/generate's vLLM engines, rebuilt when the
    switch changes its layout); return the state in force next."""
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
            stats["checkpoint_s"] = _checkpoint(pool, state, records, step + 1)
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


def _checkpoint(pool: DevicePool, state: job.JobState, records: JobRecords, step: int) -> float:
    """Every model's state as ``step``, unless that checkpoint is already written; returns seconds.
    What a failed attempt at ``step`` committed is removed first; once the checkpoint is complete,
    those past ``job.keep_checkpoints`` are deleted (storage/retention.py)."""
    run = records.run
    if retention.has_checkpoint(run.root, step):
        return 0.0
    retention.discard_partial(run.root, step, state_stages(state.layouts))
    seconds = job_ops.checkpoint(
        pool, str(run.root), state, step, digests=state.config.job.verify_transitions
    )
    records.checkpoint_s += seconds
    try:
        retention.prune_checkpoints(run.root, state.config.job.keep_checkpoints)
    except OSError as err:  # the new checkpoint is complete: the run goes on, holding one more
        get_run_logger().warning("old checkpoints could not be deleted after step %d's: %s", step, err)
    return seconds


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
                if point is None and data.val is not None and cfg.validation and cfg.validation.before_train:
                    started["val_before_train"] = generation.validate(pool, state, data.val, _on(engines))
                for step in range(point.step if point else 0, cfg.job.steps):
                    events = [e for e in state.config.job.scenario if e.step == step]
                    event = events[0] if events else growing.event(pool, state, step)  # workers warm: grow
                    state, what = job.apply_event(state, event)
                    if what:
                        source = "scenario" if events else "workers ready"
                        logger.info("%s before step %d: %s", source, step, ", ".join(what))
                        state = decide_and_switch(
                            pool, state, records, step - 1, why=f" ({', '.join(what)})", engines=engines
                        )
                    pool.note_memory(
                        {}, predicted=preflight.predicted_slot_bytes(state)
                    )  # names a lost worker
                    t = time.perf_counter()
                    run_one = STEPS[cfg.algorithm.name]
                    stats, lengths = run_one(pool, state, records, step, data.train, engines=_on(engines))
                    wall = time.perf_counter() - t
                    if data.val is not None and generation.validation_due(
                        step, cfg.job.steps, cfg.validation
                    ):
                        stats.update(generation.validate(pool, state, data.val, _on(engines)))  # not in wall
                    records.finish_step(stats, wall, cfg.job.steps)
                    if cfg.job.adapt and step + 1 < cfg.job.steps:
                        seen = {"rows": records.step_rows(step), "memory_peaks": job_ops.held_bytes(pool)}
                        state = decide_and_switch(
                            pool, state, records, step, lengths=lengths, engines=engines, **seen
                        )
                    every = cfg.job.snapshot_every
                    if every and (step + 1) % every == 0 and step + 1 < cfg.job.steps:
                        errors = _try_checkpoint(pool, state, records, step + 1)  # retried once
                        records.checkpoint_outcome(step, errors, CHECKPOINT_ATTEMPTS)
            if len(_try_checkpoint(pool, state, records, cfg.job.steps)) == CHECKPOINT_ATTEMPTS:
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


def _try_checkpoint(
    pool: DevicePool, state: job.JobState, records: JobRecords, step: int, attempts: int = CHECKPOINT_ATTEMPTS
) -> list[str]:
    """A checkpoint at ``step``, tried up to ``attempts`` times; returns the failed attempts' errors
    (``attempts`` of them: none was written, the previous checkpoint stays the resume point)."""
    errors: list[str] = []
    for attempt in range(1, attempts + 1):
        try:
            _checkpoint(pool, state, records, step)
            return errors
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")
            get_run_logger().error("checkpoint at step %d failed (attempt %d): %s", step, attempt, err)
    return errors
