"""One GRPO step on the plan in force (the job flow, flows/job/rl_job.py, runs it when
``algorithm.name`` is grpo):

    prompts, each group_size times -> actor/generate -> rule score (the reward)
      -> experience: old log-probs (actor/train), reference log-probs (reference/infer, only when the
         job has it: a KL term) -> group advantages -> actor/train on GRPO's loss (+ sync) -> rollout

No critic and no reward model: the job's stages (``NereusConfig.stages``) have neither.
"""

from __future__ import annotations

from typing import Any

from flows.job import generation, step_parts
from flows.job.data import job_data
from flows.job.records import JobRecords
from nereus_core import job
from nereus_core.plan import ModelStage
from nereus_core.prompt_source import PromptSource
from nereus_core.rl import rollout
from tasks import rollout_engines, stages
from tasks.runtime.device_pool import DevicePool

# The forward passes over the rollout, of those the job has (actor/train: the old log-probs).
PASSES = (ModelStage.REFERENCE_INFER, ModelStage.ACTOR_TRAIN)


def run_step(
    pool: DevicePool,
    state: job.JobState,
    records: JobRecords,
    step: int,
    prompt_source: PromptSource | None = None,
    *,
    engines: rollout_engines.Engines | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """One GRPO step; returns its statistics and every generated response's length (as PPO's).
    ``prompt_source``: the step's prompts (batch_size / group_size of them), stop ids and rule, as
    PPO's step takes them (flows/job/data.py; default: the count task)."""
    cfg, pid = state.config, state.plan_id
    b, group, t_len = cfg.job.batch_size, cfg.algorithm.group_size, cfg.job.response_len
    source = prompt_source or job_data(cfg).train
    r, scores = generation.rollout(pool, state, records, step, source, group=group, engines=engines)
    r.score = r.rule_score  # verifiable reward: the rule itself
    out = step_parts.forward_passes(pool, state, records, step, r, PASSES)
    r.old_logp = rollout.response_logp(out[ModelStage.ACTOR_TRAIN], t_len)
    if ModelStage.REFERENCE_INFER in out:
        r.ref_logp = rollout.response_logp(out[ModelStage.REFERENCE_INFER], t_len)
    with records.plain(step, pid, "grpo", "advantages", b * t_len):
        rollout.compute_group_advantages(r, cfg.algorithm, cfg.ppo)
    objective = stages.grpo_actor_objective(cfg.ppo, cfg.algorithm)
    trained = step_parts.train_stages(pool, state, records, step, r, {ModelStage.ACTOR_TRAIN: objective})
    step_parts.sync_engines(pool, state, records, step, engines)
    step_parts.write_rollout(records, state, step, r, scores)
    return step_parts.step_stats(state, step, r, scores, trained), r.lengths.tolist()
