"""How a PPO run starts: its run directory (fresh, or the unfinished run to resume), held by one
driver, and the models on the pool (fitted and loaded, or rehydrated from the newest checkpoint).

    fresh:   RunDir.create -> plan A -> fit the reward model (cached task; only a job with a reward
             model that reward.model_path does not name) -> load every model-stage of the job
    resume:  newest checkpoint + interrupted journals -> nereus_core.job.resume_point (finish or roll
             back each) -> the plan for the devices at hand -> rehydrate every model-stage (journaled)
             -> verify the live state against the live digests recorded with the checkpoint

With ``rollout.engine: vllm`` the run also holds actor/generate's vLLM engines
(flows/job/engine_switch.py), started once the models are resident.

Boundary: start-up only; the steps are flows/job/rl_job.py's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from flows.job.records import QuietCompletedTasks, past_transitions, rounded
from flows.job.rehydration import rehydrate_all
from nereus_core import job
from nereus_core.config import ConfigError, NereusConfig, parse_config
from nereus_core.config.from_yaml import parse_yaml
from nereus_core.engine.hf_load import hf_source
from nereus_core.plan import ModelStage, layouts_json
from storage.journal import ABORT, COMMIT, START, Journal, journals
from storage.lock import run_lock
from storage.run_dir import TRANSITIONS_TABLE, RunDir
from tasks import job_ops, model_ops, step_tasks
from tasks.runtime.device_pool import DevicePool


def resolve(config: NereusConfig | dict[str, Any] | str) -> NereusConfig:
    if isinstance(config, NereusConfig):
        return config
    if isinstance(config, str):
        config = parse_yaml(Path(config).read_text())
    return parse_config(config)  # type: ignore[arg-type]


@contextmanager
def opened(
    cfg: NereusConfig, out_dir: str, devices: int | None
) -> Iterator[tuple[RunDir, NereusConfig, job.ResumePoint | None]]:
    """The run directory, locked for this driver while the run goes on, the job's config (the
    stored one when it resumes: ``job.resumed`` makes it the config as it resumes), and the resume
    point (None: a fresh run). An unfinished run of the same config in
    ``out_dir`` is resumed; a completed one or another config's is refused (``ConfigError``)."""
    with run_lock(out_dir):
        run = RunDir(out_dir)
        if devices is not None:
            cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"devices": devices})})
        if not ((run.root / "config.yaml").exists() and run.latest_checkpoint() is not None):
            yield RunDir.create(out_dir, cfg.model_dump(mode="json")), cfg, None
            return
        if (run.root / "summary.json").exists() and run.read_summary().get("status") == "completed":
            raise ConfigError(f"{out_dir} already holds a completed run; choose another --out")
        stored = parse_config(run.read_config())
        if stored.model_copy(update={"cluster": cfg.cluster}) != cfg:
            raise ConfigError(
                f"{out_dir} holds an unfinished run of another config; continue it with "
                f"nereus resume {out_dir}, or choose another --out"
            )
        interrupted = {j.transition_id: j for j in journals(run.root) if j.status() == "interrupted"}
        point = job.resume_point(
            run.latest_checkpoint(), {k: j.header() or {} for k, j in interrupted.items()}, devices
        )
        for name, verdict in point.journals.items():
            if verdict == "finish":  # plan B, rehydrated from the checkpoint
                interrupted[name].record(
                    "transition", COMMIT, finished_by="resume", seconds=0.0, bytes_moved=0
                )
            else:
                interrupted[name].record("transition", ABORT, rolled_back_by="resume")
        run.begin_incarnation()
        yield run, stored, point


def initial_state(run: RunDir, cfg: NereusConfig, point: job.ResumePoint | None) -> job.JobState:
    """The job's state before its first step: fresh on the config's plan, or resumed at ``point``
    (the config as it resumes, the transition cost calibrated on the switches the run made)."""
    if point is None:
        return job.start(cfg)
    return job.resumed(cfg, point, past_transitions(run.read_rows(TRANSITIONS_TABLE)))


def bring_up(
    pool: DevicePool, run: RunDir, state: job.JobState, point: job.ResumePoint | None
) -> tuple[job.JobState, dict[str, Any]]:
    """``state`` with every model resident on its plan; returns it and what start-up found: the reward
    fit's figures (``fit``) or whether the resume was verified (``resume_verified_bitwise``)."""
    logger = get_run_logger()
    logger.info("device pool of %d ready; DeepSpeed warmed up in %.1f s", pool.size, model_ops.warm_up(pool))
    cfg = state.config
    if point is not None:
        verified = _resume(pool, run, state, point)
        return state, {"fit": {}, "resume_verified_bitwise": verified}
    run.write_plan(state.plan_id, layouts_json(state.layouts))
    reward = state.layouts.get(ModelStage.REWARD_INFER)
    # Nothing to fit when a rule scores the responses (GRPO's, or reward.function on text) or when
    # reward.model_path names the reward model (load_models reads it like any model directory).
    if reward is None or hf_source(cfg, "reward") is not None:
        job_ops.load_models(pool, cfg, state.layouts, state.aliased, None)
        return state, {"fit": {}}
    cache_dir = reward_fit_cache_dir()
    fit = step_tasks.fit_reward_model(pool, reward, cfg, step_tasks.reward_fit_key(cfg), cache_dir)
    if not Path(fit["path"]).exists():  # the cache outlived its file: fit again
        fit = step_tasks.fit_reward_model.with_options(refresh_cache=True)(
            pool, reward, cfg, step_tasks.reward_fit_key(cfg), cache_dir
        )
    logger.info(
        "reward model fitted: mse %s -> %s (%s)",
        rounded(fit["first_loss"]),
        rounded(fit["last_loss"]),
        fit["path"],
    )
    job_ops.load_models(pool, cfg, state.layouts, state.aliased, step_tasks.load_reward_state(fit["path"]))
    return state, {"fit": fit}


def reward_fit_cache_dir(checkout: Path | None = None) -> str:
    """Where fitted reward models are kept: ``NEREUS_CACHE_DIR``, else the user's cache directory in a
    folder of this checkout's own (its path hashed), so that another checkout, whose code may fit
    differently, never reuses this one's fit unseen."""
    if os.environ.get("NEREUS_CACHE_DIR"):
        return os.environ["NEREUS_CACHE_DIR"]
    checkout = (checkout or Path(__file__).resolve().parents[2]).resolve()
    tag = hashlib.sha256(str(checkout).encode()).hexdigest()[:12]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(base / "nereus" / f"{checkout.name}-{tag}")


def _resume(pool: DevicePool, run: RunDir, state: job.JobState, point: job.ResumePoint) -> bool:
    """Rehydrate every model of the resumed job from the checkpoint at ``point.step`` (journaled),
    then check its live state against the live digests the checkpoint recorded (True: verified)."""
    why = f"resume from the checkpoint at step {point.step}"
    if point.replan:
        why += f" on {point.devices} devices (was {point.checkpoint_devices})"
    get_run_logger().info("%s: plan %s", why, state.plan_id)
    journal = Journal(run.root, f"resume-step{point.step}-{int(time.time())}")
    new = layouts_json(state.layouts)
    journal.record(
        "transition", START, step=point.step, reason=why, route="durable", checkpoint_step=point.step, new=new
    )
    start = time.perf_counter()
    read = rehydrate_all(pool, state.config, str(run.root), journal, state.plan, point.step, pool.size)
    journal.record("transition", COMMIT, seconds=time.perf_counter() - start, bytes_moved=read)
    run.write_plan(state.plan_id, new)
    expected = run.read_checkpoint(point.step).get("live_digests")
    if not (state.config.job.verify_transitions and expected):
        return False
    job_ops.verify_live_state(pool, state.config, state.layouts, expected, what=why)
    return True


@contextmanager
def quiet_task_logs() -> Iterator[None]:
    quiet = QuietCompletedTasks()
    logging.getLogger("prefect.task_runs").addFilter(quiet)
    try:
        yield
    finally:
        logging.getLogger("prefect.task_runs").removeFilter(quiet)
