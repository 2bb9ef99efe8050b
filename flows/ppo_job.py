"""The PPO job flow: what `nereus run` does.

config --> DevicePool (one torch.distributed world over Dask workers)
       --> fit_reward_model (cached task)  --> load the four models on their layouts
       --> per step, as tasks (no subflow per step: a subflow costs ~1.3 s here):
             prompts -> actor/generate -> rule score, reward/infer, reference/infer,
             actor log-probs, critic/infer -> advantages -> actor/train, critic/train
             -> weight sync into the inference layouts
       --> per step: metrics/steps.parquet, rollouts/step=N.parquet, a timing table
           (run logger and Prefect artifact); snapshots every K steps and at the end
       --> summary.json
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flows import adapt
from flows.step_report import step_table
from flows.transition import transition_flow
from nereus_core import rollout as ro
from nereus_core.config import NereusConfig, parse_config
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.layout import Layout
from nereus_core.task import make_prompts
from storage.run_dir import STEPS_TABLE, TRANSITIONS_TABLE, RunDir
from tasks import model_ops
from tasks import ppo_stages as st
from tasks.device_pool import DevicePool
from tasks.snapshots import snapshot_model

# model-stage -> (model, head) ; the order is the order models are loaded in.
MODEL_STAGES = {
    "actor/train": ("actor", "lm"),
    "actor/generate": ("actor", "lm"),
    "reference/infer": ("reference", "lm"),
    "reward/infer": ("reward", "value"),
    "critic/train": ("critic", "value"),
    "critic/infer": ("critic", "value"),
}
# Inference copies of trained models: (inference stage, train stage) share weights or are synced.
SYNCED = (("actor/generate", "actor/train"), ("critic/infer", "critic/train"))
SNAPSHOT_SOURCES = {
    "actor": "actor/train",
    "critic": "critic/train",
    "reference": "reference/infer",
    "reward": "reward/infer",
}


class _QuietCompletedTasks(logging.Filter):
    """Drops the per-task "Finished in state Completed()" line during the steps: it costs ~3 ms a task
    here (console and API) and says nothing the step table does not. Failures, retries and every
    other task log still pass; the UI still shows every task run and its state."""

    def filter(self, record: logging.LogRecord) -> bool:
        done = str(record.msg).startswith("Finished in state Completed")
        return not (record.levelno == logging.INFO and done)


def _resolve(config: NereusConfig | dict[str, Any] | str) -> NereusConfig:
    if isinstance(config, NereusConfig):
        return config
    if isinstance(config, str):
        config = yaml.safe_load(Path(config).read_text())
    return parse_config(config)


def plan_id(plan: dict[str, Layout]) -> str:
    blob = json.dumps({k: v.model_dump(mode="json") for k, v in sorted(plan.items())}, sort_keys=True)
    return "plan-" + hashlib.sha256(blob.encode()).hexdigest()[:8]


def default_plan(cfg: NereusConfig) -> dict[str, Layout]:
    """Every model-stage the config leaves out runs colocated on all devices as pure DP (one replica each)."""
    plan = dict(cfg.plan)
    for stage in MODEL_STAGES:
        plan.setdefault(stage, Layout.contiguous(tp=1, pp=1, dp=1))
    return plan


class Job:
    """The running job's driver-side state: the pool, the plan, the run directory."""

    def __init__(self, pool: DevicePool, cfg: NereusConfig, run: RunDir) -> None:
        self.pool, self.cfg, self.run = pool, cfg, run
        self.plan = default_plan(cfg)
        self.plan_id = plan_id(self.plan)
        self.aliased = {inf for inf, src in SYNCED if self.plan[inf] == self.plan[src]}
        self.rows: list[dict[str, Any]] = []
        self.transitions: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self.controller = adapt.initial_state(cfg, self.plan, pool.size) if cfg.job.adapt else None
        self.last_transition = None

    def switch_to(self, plan: dict[str, Layout]) -> None:
        self.plan = plan
        self.plan_id = plan_id(plan)
        self.aliased = {inf for inf, src in SYNCED if plan[inf] == plan[src]}
        self.run.write_plan(self.plan_id, {k: v.model_dump(mode="json") for k, v in plan.items()})

    def config_of(self, stage: str):
        head = MODEL_STAGES[stage][1]
        return self.cfg.model.model_copy(update={"head": head})

    def load(self, reward_state: dict[str, torch.Tensor]) -> None:
        ppo = self.cfg.ppo
        for stage in MODEL_STAGES:
            layout = self.plan[stage]
            if stage in self.aliased:
                source = dict(SYNCED)[stage]
                model_ops.alias_model(self.pool, layout, name=stage, target=source)
                continue
            model = MODEL_STAGES[stage][0]
            optimizer = None
            if stage.endswith("/train"):
                lr = ppo.actor_lr if model == "actor" else ppo.critic_lr
                optimizer = OptimizerSettings(lr=lr, weight_decay=self.cfg.job.weight_decay)
            # The reward model is fitted; the critic starts from it (as OpenRLHF does).
            full = reward_state if model in ("reward", "critic") else None
            model_ops.load_model(
                self.pool,
                layout,
                name=stage,
                config=self.config_of(stage),
                optimizer=optimizer,
                full_state=full,
            )


def _record(
    job: Job, step: int, model: str, stage: str, start: float, seconds: float, tokens: int, outer: float
) -> None:
    job.rows.append(
        {
            "step": step,
            "model": model,
            "stage": stage,
            "plan_id": job.plan_id,
            "start_s": start - job.t0,
            "duration_s": seconds,
            "tokens": tokens,
            "task_overhead_s": outer - seconds,  # Prefect's share: the task call minus its body
        }
    )


def _stage(
    job: Job, step: int, model: str, stage: str, tokens: int, task_fn: Any, *args: Any, **kw: Any
) -> Any:
    start = time.perf_counter()
    out, inner = task_fn(*args, **kw)
    _record(job, step, model, stage, start, inner, tokens, time.perf_counter() - start)
    return out


def _timed_write_rollout(run: RunDir, step: int, rollout: ro.Rollout) -> tuple[Any, float]:
    start = time.perf_counter()
    run.write_rollout(step, rollout.columns())
    return None, time.perf_counter() - start


def run_step(job: Job, step: int) -> dict[str, Any]:
    """One PPO step; returns its statistics."""
    cfg, pool, plan = job.cfg, job.pool, job.plan
    b, p_len, t_len = cfg.job.batch_size, cfg.job.prompt_len, cfg.job.response_len
    prompts = make_prompts(cfg.job.task_settings, b, cfg.job.seed, step)
    gen = dict(max_new_tokens=t_len, temperature=cfg.ppo.temperature, seed=cfg.job.seed * 7919 + step)
    responses = _stage(
        job,
        step,
        "actor",
        "generate",
        b * t_len,
        st.generate,
        pool,
        plan["actor/generate"],
        prompts,
        name="actor/generate",
        **gen,
    )
    r = ro.Rollout(prompts=prompts, responses=responses, mask=torch.ones(b, t_len))
    ids, n_tok = r.ids, b * (p_len + t_len)
    # The rule score is a microsecond of tensor math: a plain call, not a task (a task costs ~5-15 ms).
    r.rule_score = _stage(job, step, "task", "rule_score", b, st.timed_rule_score, prompts, responses)
    values = _stage(
        job, step, "reward", "infer", n_tok, st.infer, pool, plan["reward/infer"], ids, name="reward/infer"
    )
    r.score = ro.final_score(values)
    ref = _stage(
        job,
        step,
        "reference",
        "infer",
        n_tok,
        st.infer,
        pool,
        plan["reference/infer"],
        ids,
        name="reference/infer",
    )
    r.ref_logp = ro.response_logp(ref, t_len)
    old = _stage(
        job, step, "actor", "infer", n_tok, st.infer, pool, plan["actor/train"], ids, name="actor/train"
    )
    r.old_logp = ro.response_logp(old, t_len)
    crit = _stage(
        job, step, "critic", "infer", n_tok, st.infer, pool, plan["critic/infer"], ids, name="critic/infer"
    )
    r.values = ro.response_values(crit, t_len)
    _stage(job, step, "ppo", "advantages", b * t_len, st.advantages, r, cfg.ppo)
    train_tokens = n_tok * cfg.ppo.ppo_epochs
    actor_loss = _stage(
        job,
        step,
        "actor",
        "train",
        train_tokens,
        st.train,
        pool,
        plan["actor/train"],
        r,
        name="actor/train",
        critic=False,
        settings=cfg.ppo,
        seed=cfg.job.seed + step,
    )
    critic_loss = _stage(
        job,
        step,
        "critic",
        "train",
        train_tokens,
        st.train,
        pool,
        plan["critic/train"],
        r,
        name="critic/train",
        critic=True,
        settings=cfg.ppo,
        seed=cfg.job.seed + step,
    )
    for inference, source in SYNCED:
        if inference not in job.aliased:
            _stage(
                job,
                step,
                MODEL_STAGES[source][0],
                "sync",
                0,
                st.sync_weights,
                pool,
                plan[source],
                plan[inference],
                src_name=source,
                dst_name=inference,
                config=job.config_of(source),
            )
    # Persisting the rollout is the step's own work (the old log-probs are checked against it): a stage.
    _stage(job, step, "rollout", "write", 0, _timed_write_rollout, job.run, step, r)
    return {
        "step": step,
        "score": float(r.score.mean()),
        "rule_score": float(r.rule_score.mean()),
        "actor_loss": actor_loss,
        "critic_loss": critic_loss,
        "kl": float((r.old_logp - r.ref_logp).mean()),
        "tokens": b * t_len,
    }


def _adapt(job: Job, step: int) -> None:
    """Ask the controller; run the transition it admits (a plan the job cannot run is refused)."""
    rows = [r for r in job.rows if r["step"] == step]
    obs = adapt.observation(
        job.cfg, job.plan, rows, step=step, devices=job.pool.size, last_transition=job.last_transition
    )
    decision = adapt.controller_step(obs, job.controller)
    job.controller, job.last_transition = decision.state, None
    adapt.log_decision(decision, step)
    if decision.action != "switch" or decision.plan is None:
        return
    new_plan = dict(decision.plan.layouts)
    problem = adapt.runnable(job.cfg, new_plan)
    if problem:
        get_run_logger().warning("controller's plan refused, keeping %s: %s", job.plan_id, problem)
        return
    transition_id = f"t{len(job.transitions):03d}-step{step}"
    old_id = job.plan_id
    stats, status = {}, "committed"
    try:
        stats = transition_flow(
            job.pool,
            job.cfg,
            str(job.run.root),
            transition_id,
            job.plan,
            new_plan,
            step=step,
            reason=decision.reason,
        )
    except Exception as err:
        status = f"failed: {type(err).__name__}"
        raise
    finally:
        job.transitions.append(
            adapt.transition_row(transition_id, step, old_id, plan_id(new_plan), decision, stats, status)
        )
        job.run.write_rows(TRANSITIONS_TABLE, job.transitions)
    if stats.get("status") == "refused":
        job.transitions[-1]["status"] = "refused"
        job.run.write_rows(TRANSITIONS_TABLE, job.transitions)
        return  # nothing moved: plan A stays in force
    job.switch_to(new_plan)
    if decision.transition is not None:
        job.last_transition = adapt.TransitionTiming(
            predicted=decision.transition, seconds=max(stats["seconds"], 1e-6)
        )
    get_run_logger().info(
        "transition %s: %s -> %s in %.2f s (predicted %.2f s), %d bytes moved",
        transition_id,
        old_id,
        job.plan_id,
        stats["seconds"],
        decision.transition.seconds if decision.transition else float("nan"),
        stats["bytes_moved"],
    )


def _snapshot_all(job: Job, step: int) -> float:
    """Snapshot every model as ``step``: the state after ``step`` steps, i.e. the one that
    generates (and scores) the rollout of step ``step``."""
    seconds = 0.0
    for model, stage in SNAPSHOT_SOURCES.items():
        _, s = snapshot_model(
            job.pool, str(job.run.root), model, step, job.plan[stage], job.config_of(stage), stage
        )
        seconds += s
    return seconds


def _finish_step(job: Job, stats: dict[str, Any], wall_s: float) -> None:
    step = stats["step"]
    rows = [r for r in job.rows if r["step"] == step]
    inside = sum(r["duration_s"] for r in rows)
    for r in rows:
        r["step_wall_s"] = wall_s
    stats.update(wall_s=wall_s, stage_s=inside, overhead_s=wall_s - inside)
    job.run.write_rows(STEPS_TABLE, job.rows)
    table = step_table(rows, stats)
    get_run_logger().info("step %d/%d\n%s", step + 1, job.cfg.job.steps, table)
    create_table_artifact(
        key="nereus-step-timings",
        table=[{k: r[k] for k in ("step", "model", "stage", "duration_s", "tokens")} for r in rows],
        description=f"Stage timings of step {step} (wall {wall_s:.3f} s, overhead {wall_s - inside:.3f} s)",
    )


@flow(name="nereus-ppo")
def ppo_job(config: NereusConfig | dict[str, Any] | str, out_dir: str = "runs/ppo") -> dict[str, Any]:
    """Run PPO for ``config.job.steps`` steps on the device pool; the run directory is ``out_dir``."""
    cfg = _resolve(config)
    logger = get_run_logger()
    run = RunDir.create(out_dir, cfg.model_dump(mode="json"))
    cache_dir = os.environ.get("NEREUS_CACHE_DIR", str(Path.home() / ".cache" / "nereus"))
    start = time.perf_counter()
    history: list[dict[str, Any]] = []
    with DevicePool(
        cfg.cluster.devices, scheduler_address=cfg.cluster.scheduler_address, backend=cfg.cluster.backend
    ) as pool:
        job = Job(pool, cfg, run)
        run.write_plan(job.plan_id, {k: v.model_dump(mode="json") for k, v in job.plan.items()})
        fit = st.fit_reward_model(pool, job.plan["reward/infer"], cfg, st.reward_fit_key(cfg), cache_dir)
        if not Path(fit["path"]).exists():  # the cache outlived its file: fit again
            fit = st.fit_reward_model.with_options(refresh_cache=True)(
                pool, job.plan["reward/infer"], cfg, st.reward_fit_key(cfg), cache_dir
            )
        logger.info("reward model fitted: mse %s -> %s", fit["first_loss"], fit["last_loss"])
        job.load(st.load_reward_state(fit["path"]))
        snapshot_s = 0.0
        quiet = _QuietCompletedTasks()
        logging.getLogger("prefect.task_runs").addFilter(quiet)
        try:
            for step in range(cfg.job.steps):
                t = time.perf_counter()
                stats = run_step(job, step)
                wall = time.perf_counter() - t
                _finish_step(job, stats, wall)
                stats["bookkeeping_s"] = time.perf_counter() - t - wall
                history.append(stats)
                if job.controller is not None and step + 1 < cfg.job.steps:
                    _adapt(job, step)
                every = cfg.job.snapshot_every
                if every and (step + 1) % every == 0 and step + 1 < cfg.job.steps:
                    snapshot_s += _snapshot_all(job, step + 1)
        finally:
            logging.getLogger("prefect.task_runs").removeFilter(quiet)
        snapshot_s += _snapshot_all(job, cfg.job.steps)
    wall_s = time.perf_counter() - start
    summary = _summary(cfg, job, history, wall_s, snapshot_s, fit)
    run.write_summary(summary)
    logger.info(
        "done: %d steps in %.1f s; rule score %.3f -> %.3f",
        cfg.job.steps,
        wall_s,
        summary["score_first"],
        summary["score_last"],
    )
    return summary


def _summary(
    cfg: NereusConfig,
    job: Job,
    history: list[dict[str, Any]],
    wall_s: float,
    snapshot_s: float,
    fit: dict[str, Any],
) -> dict[str, Any]:
    k = min(5, len(history))
    mean = lambda key, part: sum(h[key] for h in part) / len(part)  # noqa: E731
    tokens = sum(h["tokens"] for h in history)
    return {
        "status": "completed",
        "steps": len(history),
        "wall_s": wall_s,
        "reward_first": mean("score", history[:k]),
        "reward_last": mean("score", history[-k:]),
        "score_first": mean("rule_score", history[:k]),
        "score_last": mean("rule_score", history[-k:]),
        "transitions": sum(t["status"] == "committed" for t in job.transitions),
        "transition_s_total": sum(t["actual_s"] for t in job.transitions),
        "final_plan_id": job.plan_id,
        "tokens_per_s": tokens / sum(h["wall_s"] for h in history),
        "overhead_frac": sum(h["overhead_s"] for h in history) / sum(h["wall_s"] for h in history),
        "snapshot_s": snapshot_s,
        # After each step: its table to the logger, the Prefect artifact, steps.parquet (not in step walls).
        "bookkeeping_median_s": statistics.median(h["bookkeeping_s"] for h in history),
        "task_overhead_median_s": statistics.median(r["task_overhead_s"] for r in job.rows),
        "reward_fit": {"first_mse": fit["first_loss"], "last_mse": fit["last_loss"]},
        "history": history,
    }
