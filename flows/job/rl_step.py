"""The step of the job's algorithm (``algorithm.name``): PPO's here, GRPO's in flows/job/grpo_step.py.

PPO step: actor/generate -> experience (reward, reference, old log-probs, values)
          -> advantages -> actor/train (+ sync), critic/train (+ sync) -> rollout
"""

from __future__ import annotations

from typing import Any

from flows.job import generation, grpo_step, step_parts
from flows.job.data import job_data
from flows.job.records import JobRecords
from flows.job.step_context import StepContext
from nereus_core import job
from nereus_core.plan import ModelStage
from nereus_core.prompt_source import PromptSource
from nereus_core.rl import rollout
from tasks import rollout_engines, stages
from tasks.runtime.device_pool import DevicePool

PASSES = ("reward/infer", "reference/infer", "actor/train", "critic/infer")  # forward passes over the rollout
TRAINS = (ModelStage.ACTOR_TRAIN, ModelStage.CRITIC_TRAIN)  # the train stages, each with its sync


def run_step(ctx: StepContext) -> tuple[dict[str, Any], list[int]]:
    """The step of the job's algorithm on ``ctx`` (its state, records, step, engines and prompts)."""
    return STEPS[ctx.state.config.algorithm.name](
        ctx.pool, ctx.state, ctx.records, ctx.step, ctx.data.train, engines=ctx.rollout_engines
    )


def ppo_step(
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
STEPS = {"ppo": ppo_step, "grpo": grpo_step.run_step}
