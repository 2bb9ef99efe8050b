"""The parts of a step (flows/job/rl_step.py) around the algorithm's own maths:

    rollout -> the algorithm's forward passes the plan has (one task per slot group, slot groups at once:
               flows/job/phases.py; each pass recorded as its model's ``infer``)
    ... the algorithm fills the rollout and estimates advantages (nereus_core/rl/algorithms.py) ...
    the train stages (one task each, with its sync; those on disjoint slots at once)
    rollout -> rollouts/step=N.parquet (a row of its own) ; the statistics every step reports

Each task times its model-stages as spans (tasks/spans.py); the parts here open the recording around
the calls and turn its spans into the records' timed rows.

Boundary: recording and naming only; which passes and which losses are the algorithm's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from flows.job import generation, phases
from flows.job.records import JobRecords, TaskCall
from nereus_core import job, prompt_source
from nereus_core.plan import ModelStage, copies, model_of
from nereus_core.rl import algorithms, rollout
from nereus_core.rl.algorithms import Objective
from nereus_core.rl.ppo import masked_mean
from tasks import rollout_engines, spans, step_tasks
from tasks.runtime.device_pool import DevicePool


def forward_passes(
    pool: DevicePool,
    state: job.JobState,
    records: JobRecords,
    step: int,
    r: rollout.Rollout,
    passes: Iterable[ModelStage],
    reused: Iterable[ModelStage] = (),
) -> dict[ModelStage, torch.Tensor]:
    """Those of ``passes`` the plan in force has, over the rollout ``r``: one task per slot group of
    their layouts (``phases.slot_groups_of``; actor/train's for the old log-probs among them), the
    slot groups at once, each pass recorded as its model's ``infer`` over the rollout's tokens;
    their outputs by model-stage. Those of ``reused`` the plan has (passes whose result the train
    step computes itself) are recorded as ``reused`` rows, not run."""
    plan, pid = state.layouts, state.plan_id
    run = {str(k): plan[k] for k in passes if k in plan}
    n_tok = int(r.attention_mask.sum())
    groups = phases.slot_groups_of(run)
    calls = [
        [
            dict(
                pool=pool,
                layouts={k: run[k] for k in g},
                ids=r.ids,
                attention_mask=r.attention_mask,
                passes=state.config.passes,
            )
        ]
        for g in groups
    ]
    out: dict[str, torch.Tensor] = {}
    with records.phase("infer", len(groups)), spans.recording() as log:
        for (ran,) in phases.run_slot_groups(step_tasks.experience, calls):
            call = TaskCall()
            for key in ran.result:
                timed = log[key]
                call.add(model_of(key), "infer", n_tok, timed.seconds, timed.start)
            records.record_call(step, pid, call, ran.start, ran.seconds)
            out.update(ran.result)
        for stage in (s for s in reused if s in plan):
            records.reused(step, pid, model_of(stage), "infer", n_tok)
    return {ModelStage(k): out[k] for k in run}


def train_stages(
    pool: DevicePool,
    state: job.JobState,
    records: JobRecords,
    step: int,
    r: rollout.Rollout,
    objectives: Mapping[ModelStage, Objective],
) -> dict[str, dict[str, float]]:
    """The train model-stages of ``objectives`` (each with its loss) on the rollout ``r``, one task
    each with the sync of its inference copy (none when the copy is the train stage itself): those
    of one slot group one after another, the slot groups at once (``phases.slot_groups_of``). Each
    recorded as its model's ``train`` (the rollout's tokens x epochs) and ``sync``; their statistics
    by model."""
    cfg, plan, pid = state.config, state.layouts, state.plan_id
    n_tok = int(r.attention_mask.sum())
    copy_of = {source: copy for copy, source in copies(plan).items()}

    def kwargs(source: ModelStage) -> dict[str, Any]:
        copy = copy_of.get(source)
        sync = None
        if copy is not None and copy not in state.aliased:
            sync = (plan[copy], str(copy), job.model_config(cfg, source))
        return dict(
            pool=pool,
            layout=plan[source],
            rollout=r,
            name=str(source),
            objective=objectives[source],
            settings=cfg.ppo,
            seed=cfg.job.seed + step,
            sync=sync,
            passes=cfg.passes,
        )

    groups = phases.slot_groups_of({str(s): plan[s] for s in objectives})
    trained: dict[str, dict[str, float]] = {}
    with records.phase("train", len(groups)), spans.recording() as log:
        done = phases.run_slot_groups(step_tasks.train, [[kwargs(ModelStage(s)) for s in g] for g in groups])
        for group, ran_group in zip(groups, done, strict=True):
            for source, ran in zip(group, ran_group, strict=True):
                model, timed = model_of(source), log[source]
                synced = log.get(step_tasks.sync_span(source))  # None: no copy to sync
                trained[model] = ran.result
                call = TaskCall()
                call.add(model, "train", n_tok * cfg.ppo.ppo_epochs, timed.seconds, timed.start)
                call.add(
                    model, "sync", 0, synced.seconds if synced else 0.0, synced.start if synced else None
                )
                records.record_call(step, pid, call, ran.start, ran.seconds)
    return {model_of(s): trained[model_of(s)] for s in objectives}


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
    with records.task_call(step, state.plan_id) as call, spans.recording() as log:
        step_tasks.sync_engines(pool, engines, state.layouts[ModelStage.ACTOR_TRAIN])
        call.add("actor", "sync", 0, log[step_tasks.sync_span("actor/train")].seconds)


def write_rollout(
    records: JobRecords, state: job.JobState, step: int, r: rollout.Rollout, scores: prompt_source.Scores
) -> None:
    """Persist the rollout: the step's own work (the old log-probs are checked against it), a row."""
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
    reward function's extras (``reward_<name>``). With the old log-prob pass reused the KL is the
    actor's train step's (``algorithms.REF_KL``, the same token-mean on the same log-probs)."""
    trained = {model: dict(stats) for model, stats in trained.items()}
    ref_kl = trained.get("actor", {}).pop(algorithms.REF_KL, None)
    kl = {}
    if r.ref_logp is not None:
        kl["kl"] = float(masked_mean(r.old_logp - r.ref_logp, r.mask)) if r.old_logp is not None else ref_kl
    return {
        "step": step,
        "plan_id": state.plan_id,
        "score": float(r.score.mean()),
        "rule_score": float(r.rule_score.mean()),
        **kl,
        "tokens": int(r.mask.sum()),
        **{f"{model}_{k}": v for model, stats in trained.items() for k, v in stats.items()},
        **rollout.length_stats(r.mask, state.config.job.response_len),
        "prompt_len_mean": float(r.prompt_lengths.double().mean()),
        "prompt_len_max": float(r.prompt_lengths.max()),
        **rollout.engine_logp_gap(r),
        **{f"reward_{k}": v for k, v in scores.extras.items()},
    }
