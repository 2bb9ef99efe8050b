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
from prefect import Task, flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run as prefect_flow_run

from flows import adapt
from flows.step_report import step_table
from flows.transition import (
    COPIES,
    OWN_STATE,
    optimizer_settings,
    rehydrate_all,
    stage_config,
    transition_flow,
)
from nereus_core import rollout as ro
from nereus_core.config import ConfigError, ModelConfig, NereusConfig, parse_config
from nereus_core.layout import Layout
from nereus_core.plan import model_of
from nereus_core.task import make_prompts
from storage.journal import ABORT, COMMIT, START, Journal, journals
from storage.run_dir import STEPS_TABLE, TRANSITIONS_TABLE, RunDir
from storage.snapshot import list_snapshots, read_full_state
from tasks import model_ops
from tasks import ppo_stages as st
from tasks.device_pool import DevicePool
from tasks.reshard import gather_state
from tasks.snapshots import snapshot_model

HISTORY_TABLE = "metrics/history.parquet"  # one row per step: scores, losses, wall and overhead

# Every model-stage, in the order the job loads them: a copy after the stage it follows.
LOAD_ORDER = (*OWN_STATE, *COPIES)
SNAPSHOT_SOURCES = {model_of(stage): stage for stage in OWN_STATE}  # model -> the stage holding its state


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


def _slots(plan: dict[str, Layout]) -> int:
    """How many device slots ``plan`` needs (its highest slot + 1)."""
    return 1 + max(max(layout.devices) for layout in plan.values())


def default_plan(cfg: NereusConfig) -> dict[str, Layout]:
    """Every model-stage the config leaves out runs colocated on all devices as pure DP (one replica each)."""
    plan = dict(cfg.plan)
    for stage in LOAD_ORDER:
        plan.setdefault(stage, Layout.contiguous(tp=1, pp=1, dp=1))
    return plan


class Job:
    """The running job's driver-side state: the pool, the plan, the run directory."""

    def __init__(
        self, pool: DevicePool, cfg: NereusConfig, run: RunDir, plan: dict[str, Layout] | None = None
    ) -> None:
        # ``cfg`` is the job's config as it is now: scenario events change its devices and response_len.
        self.pool, self.cfg, self.run = pool, cfg, run
        self.plan = default_plan(cfg) if plan is None else dict(plan)
        self.plan_id = plan_id(self.plan)
        self.rows: list[dict[str, Any]] = []
        self.transitions: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        # The controller follows every step; it may switch on its own only with job.adapt, but device
        # and response-length changes (scenario events) always go through it.
        self.controller = adapt.initial_state(cfg, self.plan, pool.size)
        self.last_transition = None
        self.checkpoint_s = 0.0
        self.task_overheads: list[float] = []  # per Prefect task call: its time outside its stages

    def switch_to(self, plan: dict[str, Layout]) -> None:
        self.plan = plan
        self.plan_id = plan_id(plan)
        self.run.write_plan(self.plan_id, {k: v.model_dump(mode="json") for k, v in plan.items()})

    @property
    def aliased(self) -> set[str]:
        """Inference copies on exactly their train stage's layout: they share its shards, no sync."""
        return {copy for copy, source in COPIES.items() if self.plan[copy] == self.plan[source]}

    def config_of(self, stage: str) -> ModelConfig:
        return stage_config(self.cfg, stage)

    def load(self, reward_state: dict[str, torch.Tensor]) -> None:
        for stage in LOAD_ORDER:
            layout = self.plan[stage]
            if stage in self.aliased:
                model_ops.alias_model(self.pool, layout, name=stage, target=COPIES[stage])
                continue
            model = model_of(stage)
            optimizer = optimizer_settings(self.cfg, stage)
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
    outer = time.perf_counter() - start
    _record(job, step, model, stage, start, inner, tokens, outer)
    if isinstance(task_fn, Task):  # not a plain driver-side call
        job.task_overheads.append(outer - inner)
    return out


def _stages(
    job: Job, step: int, rows: dict[str, tuple[str, str, int]], task_fn: Any, *args: Any, **kw: Any
) -> Any:
    """A task that runs several stages, each timed inside it: ``rows[key] = (model, stage, tokens)``
    for every key of the seconds it returns; Prefect's share is split evenly between them."""
    start = time.perf_counter()
    out, seconds = task_fn(*args, **kw)
    outer = time.perf_counter() - start
    job.task_overheads.append(outer - sum(seconds.values()))
    share = (outer - sum(seconds.values())) / len(seconds)
    for key, inner in seconds.items():
        model, stage, tokens = rows[key]
        _record(job, step, model, stage, start, inner, tokens, inner + share)
    return out


def _timed_write_rollout(run: RunDir, step: int, rollout: ro.Rollout) -> tuple[Any, float]:
    start = time.perf_counter()
    run.write_rollout(step, rollout.columns())
    return None, time.perf_counter() - start


def run_step(job: Job, step: int) -> dict[str, Any]:
    """One PPO step; returns its statistics.

    Prefect tasks: actor/generate -> experience (reward/infer, reference/infer, actor log-probs,
    critic/infer) -> actor/train (+ weight sync) -> critic/train (+ weight sync). The rule score,
    advantages and the rollout's write are driver-side plain calls of a few ms, timed as stages.
    """
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
    r.rule_score = _stage(job, step, "task", "rule_score", b, st.timed_rule_score, prompts, responses)
    passes = {
        "reward/infer": ("reward", "infer", n_tok),
        "reference/infer": ("reference", "infer", n_tok),
        "actor/train": ("actor", "infer", n_tok),  # the old log-probs, on the train layout
        "critic/infer": ("critic", "infer", n_tok),
    }
    out = _stages(job, step, passes, st.experience, pool, {k: plan[k] for k in passes}, ids)
    r.score = ro.final_score(out["reward/infer"])
    r.ref_logp = ro.response_logp(out["reference/infer"], t_len)
    r.old_logp = ro.response_logp(out["actor/train"], t_len)
    r.values = ro.response_values(out["critic/infer"], t_len)
    _stage(job, step, "ppo", "advantages", b * t_len, st.advantages, r, cfg.ppo)
    losses = {}
    for inference, source in COPIES.items():
        model = model_of(source)
        sync = None if inference in job.aliased else (plan[inference], inference, job.config_of(source))
        rows = {"train": (model, "train", n_tok * cfg.ppo.ppo_epochs), "sync": (model, "sync", 0)}
        losses[model] = _stages(
            job,
            step,
            rows,
            st.train,
            pool,
            plan[source],
            r,
            name=source,
            critic=model == "critic",
            settings=cfg.ppo,
            seed=cfg.job.seed + step,
            sync=sync,
        )
    # Persisting the rollout is the step's own work (the old log-probs are checked against it): a stage.
    _stage(job, step, "rollout", "write", 0, _timed_write_rollout, job.run, step, r)
    return {
        "step": step,
        "score": float(r.score.mean()),
        "rule_score": float(r.rule_score.mean()),
        "actor_loss": losses["actor"],
        "critic_loss": losses["critic"],
        "kl": float((r.old_logp - r.ref_logp).mean()),
        "tokens": b * t_len,
    }


def _adapt(job: Job, step: int, *, rows: list[dict[str, Any]] | None = None, why: str = "") -> None:
    """Ask the controller (after ``step``, on its timings); run the transition it admits or forces.
    A plan the job's config would reject is refused; so is a switch whose checkpoint cannot be written."""
    rows = [r for r in job.rows if r["step"] == step] if rows is None else rows
    obs = adapt.observation(
        job.cfg,
        job.plan,
        rows,
        step=step,
        devices=job.cfg.cluster.devices,
        last_transition=job.last_transition,
    )
    decision = adapt.controller_step(obs, job.controller)
    job.controller, job.last_transition = decision.state, None
    adapt.log_decision(decision, step)
    if decision.action == "none":
        raise RuntimeError(f"after step {step}{why}: {decision.reason}; give the job more devices or memory")
    new_plan = dict(decision.plan.layouts) if decision.action == "switch" and decision.plan else None
    problem = new_plan and adapt.runnable(job.cfg, new_plan)
    if problem:
        get_run_logger().warning("controller's plan refused, keeping %s: %s", job.plan_id, problem)
        new_plan = None
    if new_plan is None and job.cfg.cluster.devices != job.pool.size:
        new_plan = dict(job.plan)  # the devices changed and the current plan stays: keep it, in a new world
    if new_plan is not None:
        _transition(job, step, new_plan, decision, decision.reason)


def _transition(job: Job, step: int, new_plan: dict[str, Layout], decision: Any, reason: str) -> None:
    """Checkpoint plan A at step + 1, then run the transition subflow to ``new_plan``."""
    logger = get_run_logger()
    transition_id = f"t{len(job.transitions):03d}-step{step}"
    old_id, devices = job.plan_id, job.cfg.cluster.devices
    stats: dict[str, Any] = {}
    checkpoint = _checkpoint(job, step + 1)
    if checkpoint is None:
        # Without a recovery point a crash mid-switch could lose state: plan A stays in force.
        row = adapt.transition_row(transition_id, step, old_id, plan_id(new_plan), decision, {}, "aborted")
        row["reason"] = f"{reason}; aborted: the checkpoint could not be written"
        job.transitions.append(row)
        job.run.write_rows(TRANSITIONS_TABLE, job.transitions)
        if devices != job.pool.size:
            raise RuntimeError(
                f"the device set changed but no checkpoint could be written at step {step + 1}"
            )
        return
    status = "committed"
    probe = _probe(job, job.plan) if job.cfg.job.verify_transitions else None
    try:
        stats = transition_flow(
            job.pool,
            job.cfg,
            str(job.run.root),
            transition_id,
            job.plan,
            new_plan,
            step=step,
            reason=reason,
            checkpoint_step=step + 1,
            devices=devices,
        )
    except Exception as err:
        status = f"failed: {type(err).__name__}"
        raise
    finally:
        row = adapt.transition_row(transition_id, step, old_id, plan_id(new_plan), decision, stats, status)
        row.update(reason=reason, route=stats.get("route", ""), checkpoint_s=checkpoint)
        row["gtg_critical_path_s"] = stats.get("gtg_critical_path_s", 0.0)
        row["devices"] = devices
        job.transitions.append(row)
        job.run.write_rows(TRANSITIONS_TABLE, job.transitions)
        keys = ("transition_id", "status", "route", "reason", "predicted_cost_s", "actual_s", "bytes_moved")
        create_table_artifact(
            key="nereus-transitions",
            table=[{k: t.get(k) for k in keys} for t in job.transitions],
            description="Plan switches of this run so far (metrics/transitions.parquet)",
        )
    if stats.get("status") == "refused":
        job.transitions[-1]["status"] = "refused"
        job.run.write_rows(TRANSITIONS_TABLE, job.transitions)
        return  # nothing moved: plan A stays in force
    job.switch_to(new_plan)
    if probe is not None:
        job.transitions[-1].update(_verify(job, step + 1, probe))
        job.run.write_rows(TRANSITIONS_TABLE, job.transitions)
    if decision.transition is not None and stats.get("route") != "durable":
        job.last_transition = adapt.TransitionTiming(
            predicted=decision.transition, seconds=max(stats["seconds"], 1e-6)
        )
    logger.info(
        "transition %s (%s route): %s -> %s in %.2f s (predicted %.2f s), %d bytes moved; reason: %s",
        transition_id,
        stats.get("route"),
        old_id,
        job.plan_id,
        stats["seconds"],
        decision.transition.seconds if decision.transition else float("nan"),
        stats["bytes_moved"],
        reason,
    )


PROBED = ("actor/train", "critic/train")


def _probe(job: Job, plan: dict[str, Layout]) -> dict[str, torch.Tensor]:
    """The actor's log-probs and the critic's values on a fixed batch (the verification's inputs)."""
    settings = job.cfg.job.task_settings
    prompts = make_prompts(settings, 8, seed=12345, step=0)
    gen = torch.Generator().manual_seed(12345)
    responses = torch.randint(1, job.cfg.model.vocab_size, (8, job.cfg.job.response_len), generator=gen)
    ids = torch.cat([prompts, responses], dim=1)
    return {s: model_ops.forward(job.pool, plan[s], ids, name=s) for s in PROBED}


def _verify_state(job: Job, checkpoint_step: int) -> None:
    """Every model's full state as the devices hold it == its checkpoint at ``checkpoint_step``, bitwise."""
    for model, stage in SNAPSHOT_SOURCES.items():
        now = gather_state(
            job.pool, job.plan[stage], name=stage, config=job.config_of(stage), train=stage.endswith("/train")
        )
        saved = read_full_state(job.run.root, model, checkpoint_step, optimizer=True)
        differ = sorted(k for k in saved if k not in now or not torch.equal(now[k], saved[k]))
        if differ or set(now) != set(saved):
            raise RuntimeError(
                f"{model}'s state differs from its checkpoint at step {checkpoint_step} in {differ[:3]}"
            )


def _verify(job: Job, checkpoint_step: int, before: dict[str, torch.Tensor]) -> dict[str, Any]:
    """After a switch: the state == plan A's checkpoint bitwise, and the probe's outputs under the new
    plan == plan A's (<= 1e-5). Raises if not (the checkpoint stays intact)."""
    _verify_state(job, checkpoint_step)
    after = _probe(job, job.plan)
    diff = max((after[s] - before[s]).abs().max().item() for s in PROBED)
    if diff > 1e-5:
        raise RuntimeError(f"after the switch the probe's outputs moved by {diff:.2e} > 1e-5")
    get_run_logger().info("verified: every model's state bitwise equal, probe outputs within %.1e", diff)
    return {"verified_bitwise": True, "verified_max_diff": diff}


def _checkpoint(job: Job, step: int) -> float | None:
    """Snapshot every model's whole state as ``step`` (the state that generates rollout ``step``) and
    mark it a resume point; returns seconds, or None when a write failed (the previous point stays)."""
    if job.run.checkpoint_path(step).exists():
        return 0.0
    start = time.perf_counter()
    try:
        for model, stage in SNAPSHOT_SOURCES.items():
            if any(r.step == step for r in list_snapshots(job.run.root, model)):
                continue  # written before a failure of another model's snapshot
            snapshot_model(
                job.pool,
                str(job.run.root),
                model,
                step,
                job.plan[stage],
                job.config_of(stage),
                stage,
                optimizer_settings(job.cfg, stage),
            )
    except Exception as err:
        get_run_logger().error("snapshot at step %d failed, the last checkpoint stays: %s", step, err)
        return None
    job.run.write_checkpoint(
        step,
        {
            "plan_id": job.plan_id,
            "plan": {k: v.model_dump(mode="json") for k, v in job.plan.items()},
            "devices": job.pool.size,
            "response_len": job.cfg.job.response_len,
        },
    )
    seconds = time.perf_counter() - start
    job.checkpoint_s += seconds
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


def _apply_event(job: Job, step: int) -> None:
    """A scenario event before ``step``: change devices and/or response length, then re-plan."""
    events = [e for e in job.cfg.job.scenario if e.step == step]
    if not events:
        return
    event, cfg = events[0], job.cfg
    what = []
    if event.devices is not None and event.devices != cfg.cluster.devices:
        what.append(f"devices {cfg.cluster.devices} -> {event.devices}")
        cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"devices": event.devices})})
    if event.response_len is not None and event.response_len != cfg.job.response_len:
        what.append(f"response length {cfg.job.response_len} -> {event.response_len}")
        cfg = cfg.model_copy(update={"job": cfg.job.model_copy(update={"response_len": event.response_len})})
    if not what:
        return
    job.cfg = cfg
    get_run_logger().info("scenario before step %d: %s", step, ", ".join(what))
    _adapt(job, step - 1, rows=[], why=f" ({', '.join(what)})")


def _resume_point(run: RunDir, cfg: NereusConfig, devices: int | None) -> tuple[dict[str, Any], NereusConfig]:
    """The newest checkpoint of ``run`` and the job's config as it was there (devices, response length);
    an interrupted transition is finished (its plan B, when the devices allow) or rolled back."""
    record = run.latest_checkpoint()
    if record is None:
        raise FileNotFoundError(
            f"{run.root} has no checkpoint to resume from; start it again with nereus run"
        )
    step = int(record["step"])
    plan = {k: Layout.model_validate(v) for k, v in record["plan"].items()}
    n = devices or int(record["devices"])
    for journal in journals(run.root):
        if journal.status() != "interrupted":
            continue
        header = journal.header() or {}
        target = {k: Layout.model_validate(v) for k, v in header.get("new", {}).items()}
        if header.get("checkpoint_step") == step and target and _slots(target) <= n:
            plan = target  # finish the switch: plan B, rehydrated from the checkpoint
            journal.record("transition", COMMIT, finished_by="resume", seconds=0.0, bytes_moved=0)
        else:
            journal.record("transition", ABORT, rolled_back_by="resume")
    cfg = cfg.model_copy(
        update={
            "cluster": cfg.cluster.model_copy(update={"devices": n}),
            "job": cfg.job.model_copy(update={"response_len": int(record["response_len"])}),
        }
    )
    return {"step": step, "plan": plan, "devices": n, "record_devices": int(record["devices"])}, cfg


def _load_checkpoint(job: Job, step: int, why: str) -> None:
    """Rehydrate every model of the job under ``job.plan`` from the checkpoint at ``step`` (journaled)."""
    journal = Journal(job.run.root, f"resume-step{step}-{int(time.time())}")
    new = {k: v.model_dump(mode="json") for k, v in job.plan.items()}
    journal.record("transition", START, step=step, reason=why, route="durable", checkpoint_step=step, new=new)
    start = time.perf_counter()
    read = rehydrate_all(job.pool, job.cfg, str(job.run.root), journal, job.plan, step, job.pool.size)
    journal.record("transition", COMMIT, seconds=time.perf_counter() - start, bytes_moved=read)
    job.switch_to(job.plan)


def _open_run(
    cfg: NereusConfig, out_dir: str, devices: int | None
) -> tuple[RunDir, NereusConfig, dict[str, Any] | None]:
    """A fresh run directory, or the unfinished run of the same config in it (to resume)."""
    run = RunDir(out_dir)
    if devices is not None:
        cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"devices": devices})})
    if (run.root / "config.yaml").exists() and run.latest_checkpoint() is not None:
        if (run.root / "summary.json").exists() and run.read_summary().get("status") == "completed":
            raise ConfigError(f"{out_dir} already holds a completed run; choose another --out")
        stored = parse_config(run.read_config())
        if stored.model_copy(update={"cluster": cfg.cluster}) != cfg:
            raise ConfigError(
                f"{out_dir} holds an unfinished run of another config; continue it with "
                f"nereus resume {out_dir}, or choose another --out"
            )
        point, cfg = _resume_point(run, stored, devices)
        return run, cfg, point
    return RunDir.create(out_dir, cfg.model_dump(mode="json")), cfg, None


def _resume(job: Job, point: dict[str, Any]) -> None:
    """Carry on from a checkpoint: the plan for the devices at hand, the state rehydrated under it."""
    step = point["step"]
    job.rows = [r for r in job.run.read_rows(STEPS_TABLE) if r["step"] < step]
    job.transitions = job.run.read_rows(TRANSITIONS_TABLE)
    why = f"resume from the checkpoint at step {step}"
    if point["devices"] != point["record_devices"] or _slots(job.plan) > job.pool.size:
        # Another number of devices: the controller picks the plan for the devices at hand.
        job.controller = adapt.initial_state(job.cfg, job.plan, point["record_devices"])
        obs = adapt.observation(
            job.cfg, job.plan, [], step=max(step - 1, 0), devices=job.pool.size, last_transition=None
        )
        decision = adapt.controller_step(obs, job.controller)
        adapt.log_decision(decision, step)
        if decision.plan is None:
            raise RuntimeError(f"{why} on {job.pool.size} devices: {decision.reason}")
        job.controller, job.plan = decision.state, dict(decision.plan.layouts)
        why += f" on {job.pool.size} devices (was {point['record_devices']})"
    get_run_logger().info("%s: plan %s", why, plan_id(job.plan))
    _load_checkpoint(job, step, why)
    if job.cfg.job.verify_transitions:
        _verify_state(job, step)
        get_run_logger().info(
            "verified: the rehydrated state equals the checkpoint at step %d, bitwise", step
        )
        point["verified_bitwise"] = True


@flow(name="nereus-ppo")
def ppo_job(
    config: NereusConfig | dict[str, Any] | str, out_dir: str | None = None, devices: int | None = None
) -> dict[str, Any]:
    """Run PPO for ``config.job.steps`` steps on the device pool; the run directory is ``out_dir``.

    If ``out_dir`` holds an unfinished run of the same config (a checkpoint, no completed summary:
    the driver died, or this is a retry of the failed flow run; ``out_dir`` defaults to
    ``runs/<name>-<flow run id>``), it resumes from its newest
    checkpoint instead: an interrupted transition is finished or rolled back, and ``devices``
    (default: as at the checkpoint) may differ, the controller picking the plan for them.
    """
    cfg, logger = _resolve(config), get_run_logger()
    if out_dir is None:  # one directory per flow run: a retry of this flow run finds (and resumes) it
        out_dir = f"runs/{cfg.name}-{str(prefect_flow_run.id)[:8]}"
    run, cfg, point = _open_run(cfg, out_dir, devices)
    cache_dir = os.environ.get("NEREUS_CACHE_DIR", str(Path.home() / ".cache" / "nereus"))
    start = time.perf_counter()
    fit: dict[str, Any] = {}
    first = 0 if point is None else point["step"]
    with DevicePool.for_cluster(cfg.cluster) as pool:
        logger.info(
            "device pool of %d ready; DeepSpeed warmed up in %.1f s", pool.size, model_ops.warm_up(pool)
        )
        job = Job(pool, cfg, run, plan=None if point is None else point["plan"])
        if point is None:
            run.write_plan(job.plan_id, {k: v.model_dump(mode="json") for k, v in job.plan.items()})
            fit = st.fit_reward_model(pool, job.plan["reward/infer"], cfg, st.reward_fit_key(cfg), cache_dir)
            if not Path(fit["path"]).exists():  # the cache outlived its file: fit again
                fit = st.fit_reward_model.with_options(refresh_cache=True)(
                    pool, job.plan["reward/infer"], cfg, st.reward_fit_key(cfg), cache_dir
                )
            logger.info("reward model fitted: mse %s -> %s", fit["first_loss"], fit["last_loss"])
            job.load(st.load_reward_state(fit["path"]))
        else:
            _resume(job, point)
        history = [h for h in run.read_rows(HISTORY_TABLE) if h["step"] < first]
        quiet = _QuietCompletedTasks()
        logging.getLogger("prefect.task_runs").addFilter(quiet)
        try:
            for step in range(first, cfg.job.steps):
                _apply_event(job, step)
                t = time.perf_counter()
                stats = run_step(job, step)
                wall = time.perf_counter() - t
                _finish_step(job, stats, wall)
                stats["bookkeeping_s"] = time.perf_counter() - t - wall
                stats["plan_id"] = job.plan_id
                history.append(stats)
                run.write_rows(HISTORY_TABLE, history)
                if cfg.job.adapt and step + 1 < cfg.job.steps:
                    _adapt(job, step)
                every = cfg.job.snapshot_every
                if every and (step + 1) % every == 0 and step + 1 < cfg.job.steps:
                    _checkpoint(job, step + 1)
        finally:
            logging.getLogger("prefect.task_runs").removeFilter(quiet)
        if _checkpoint(job, cfg.job.steps) is None and _checkpoint(job, cfg.job.steps) is None:
            raise RuntimeError(f"the final snapshot (step {cfg.job.steps}) could not be written twice")
    wall_s = time.perf_counter() - start
    summary = _summary(job.cfg, job, history, wall_s, job.checkpoint_s, fit)
    if point is not None:
        summary["resumed_from_step"] = first
        summary["resume_verified_bitwise"] = point.get("verified_bitwise", False)
    run.write_summary(summary)
    logger.info(
        "done: %d steps in %.1f s; rule score %.3f -> %.3f; %d transitions",
        cfg.job.steps,
        wall_s,
        summary["score_first"],
        summary["score_last"],
        summary["transitions"],
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
        "task_overhead_median_s": statistics.median(job.task_overheads) if job.task_overheads else None,
        "reward_fit": {"first_mse": fit.get("first_loss"), "last_mse": fit.get("last_loss")},
        "history": history,
    }
