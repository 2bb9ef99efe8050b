"""What PPO's step (flows/job/rl_job.py) and GRPO's (flows/job/grpo_step.py) do alike after generation:

    rollout -> the forward passes the job has (one task, each pass recorded as ``infer``)
    ... each algorithm's advantages and training ...
    rollout -> rollouts/step=N.parquet (a stage of its own) ; the statistics every step reports

Boundary: recording and naming only; which passes and which losses are each step's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from flows.job import generation
from flows.job.records import JobRecords
from nereus_core import job, prompt_source
from nereus_core.plan import ModelStage
from nereus_core.rl import rollout
from nereus_core.rl.ppo import masked_mean
from tasks import rollout_engines, stages
from tasks.runtime.device_pool import DevicePool


def forward_passes(
    pool: DevicePool,
    state: job.JobState,
    records: JobRecords,
    step: int,
    r: rollout.Rollout,
    passes: Iterable[str],
) -> dict[str, torch.Tensor]:
    """Those of ``passes`` (model-stages) the plan in force has, over the rollout ``r`` in one task,
    each recorded as its model's ``infer`` over the rollout's tokens; their outputs by model-stage."""
    plan, pid = state.layouts, state.plan_id
    run = [ModelStage(k) for k in passes if k in plan]
    n_tok = int(r.attention_mask.sum())
    with records.task_call(step, pid) as call:
        out, seconds = stages.experience(pool, {str(k): plan[k] for k in run}, r.ids, r.attention_mask)
        for key in run:
            call.add(key.model, "infer", n_tok, seconds[key])
    return out


def sync_engines(
    pool: DevicePool,
    state: job.JobState,
    records: JobRecords,
    step: int,
    engines: rollout_engines.Engines | None,
) -> None:
    """actor/train's new weights into actor/generate's vLLM engines (none: nothing to do), timed as
    the actor's sync."""
    if engines is None:
        return
    with records.task_call(step, state.plan_id) as call:
        synced = stages.sync_engines(pool, engines, state.layouts[ModelStage.ACTOR_TRAIN])
        call.add("actor", "sync", 0, synced["seconds"])


def write_rollout(
    records: JobRecords, state: job.JobState, step: int, r: rollout.Rollout, scores: prompt_source.Scores
) -> None:
    """Persist the rollout: the step's own work (the old log-probs are checked against it), a stage."""
    with records.plain(step, state.plan_id, "rollout", "write", 0):
        records.run.write_rollout(step, generation.rollout_columns(r, scores))


def step_stats(
    state: job.JobState,
    step: int,
    r: rollout.Rollout,
    scores: prompt_source.Scores,
    trained: Mapping[str, Mapping[str, float]],
) -> dict[str, Any]:
    """What every step reports: scores, the KL to the reference (when the job runs it), tokens, each
    trained model's statistics (``<model>_<name>``, in ``trained``'s order), response lengths and the
    reward function's extras (``reward_<name>``)."""
    kl = {"kl": float(masked_mean(r.old_logp - r.ref_logp, r.mask))} if r.ref_logp is not None else {}
    return {
        "step": step,
        "plan_id": state.plan_id,
        "score": float(r.score.mean()),
        "rule_score": float(r.rule_score.mean()),
        **kl,
        "tokens": int(r.mask.sum()),
        **{f"{model}_{k}": v for model, stats in trained.items() for k, v in stats.items()},
        **rollout.length_stats(r.mask, state.config.job.response_len),
        **rollout.engine_logp_gap(r),
        **{f"reward_{k}": v for k, v in scores.extras.items()},
    }
