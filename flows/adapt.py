"""The job's adaptive loop: after a step, ask the controller; when it admits a switch, run the transition.

    step rows --observation--> controller task (decide) --keep--> next step
                                              \\--switch--> transition subflow --> plan B, transitions table
The controller decides; this module only turns the job's measurements into an
Observation and a Decision into a transition (and refuses a plan the job's
config would reject, e.g. a train layout that does not divide its mini-batches).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nereus_core.config import ConfigError, NereusConfig, parse_config
from nereus_core.controller import (
    ControllerState,
    Decision,
    Observation,
    StageTiming,
    TransitionTiming,
    decide,
)
from nereus_core.cost_model import TransitionEstimate, Workload
from nereus_core.hardware import get_profile
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan, infer_placement
from storage.run_dir import TRANSITIONS_TABLE

TIMED = {
    ("actor", "generate"): "actor/generate",
    ("actor", "train"): "actor/train",
    ("critic", "train"): "critic/train",
    ("critic", "infer"): "critic/infer",
    ("reference", "infer"): "reference/infer",
    ("reward", "infer"): "reward/infer",
}


def initial_state(cfg: NereusConfig, plan: dict[str, Layout], devices: int) -> ControllerState:
    global_plan = GlobalPlan(placement=infer_placement(plan), layouts=plan)
    return ControllerState.initial(cfg.model, get_profile(cfg.job.profile), plan=global_plan, devices=devices)


def observation(
    cfg: NereusConfig,
    plan: dict[str, Layout],
    rows: list[dict[str, Any]],
    *,
    step: int,
    devices: int,
    last_transition: TransitionTiming | None,
) -> Observation:
    timings = tuple(
        StageTiming(
            stage=TIMED[(r["model"], r["stage"])],
            layout=plan[TIMED[(r["model"], r["stage"])]],
            seconds=r["duration_s"],
        )
        for r in rows
        if (r["model"], r["stage"]) in TIMED and r["duration_s"] > 0
    )
    workload = Workload(
        batch=cfg.job.batch_size,
        prompt_len=cfg.job.prompt_len,
        response_mean=cfg.job.response_len,
        response_high=cfg.job.response_len,
        ppo_epochs=cfg.ppo.ppo_epochs,
    )
    return Observation(
        step=step,
        remaining_steps=cfg.job.steps - step - 1,
        devices=devices,
        memory_per_device=int(cfg.cluster.memory_per_device),
        workload=workload,
        timings=timings,
        transition=last_transition,
    )


@task(cache_policy=NO_CACHE)
def controller_step(obs: Observation, state: ControllerState) -> Decision:
    """Recalibrate on the step's timings and decide: keep, or switch to a better plan."""
    return decide(obs, state)


def runnable(cfg: NereusConfig, layouts: dict[str, Layout]) -> str | None:
    """Why the job cannot run ``layouts`` (its config's rules), or None."""
    data = cfg.model_dump(mode="json")
    data["plan"] = {k: v.model_dump(mode="json") for k, v in layouts.items()}
    try:
        parse_config(data)
    except ConfigError as err:
        return str(err)
    return None


def log_decision(decision: Decision, step: int) -> None:
    logger = get_run_logger()
    cost = decision.transition.seconds if decision.transition else 0.0
    logger.info(
        "controller after step %d: %s%s (%s); gain %.4f s/step x %d steps vs cost %.3f s; decided in %.1f ms",
        step,
        decision.action,
        " (forced)" if decision.forced else "",
        decision.reason,
        decision.gain_per_step_s,
        decision.horizon_steps,
        cost,
        decision.elapsed_s * 1000,
    )
    for alt in decision.alternatives[:3]:
        logger.info("  rejected %s: %s (%s)", alt.description, alt.reason, alt.detail)


def transition_row(
    transition_id: str,
    step: int,
    old_id: str,
    new_id: str,
    decision: Decision,
    stats: dict[str, Any],
    status: str,
) -> dict[str, Any]:
    predicted: TransitionEstimate | None = decision.transition
    return {
        "transition_id": transition_id,
        "step": step,
        "from_plan_id": old_id,
        "to_plan_id": new_id,
        "reason": decision.reason,
        "forced": decision.forced,
        "predicted_gain_s": decision.gain_per_step_s * decision.horizon_steps,
        "predicted_cost_s": predicted.seconds if predicted else 0.0,
        "actual_s": stats.get("seconds", 0.0),
        "bytes_moved": int(stats.get("bytes_moved", 0)),
        "status": status,
        "recorded_at": time.time(),
    }


__all__ = [
    "TRANSITIONS_TABLE",
    "TransitionTiming",
    "controller_step",
    "initial_state",
    "log_decision",
    "observation",
    "runnable",
    "transition_row",
]
