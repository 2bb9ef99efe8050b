"""One step of the job's algorithm (``algorithm.name``), the same for every entry of the registry
(nereus_core/rl/algorithms.py says what differs: the passes, the estimator, the objectives):

    actor/generate (group_size responses per prompt) -> rule score
      -> the algorithm's forward passes the plan has -> fill the rollout (old and reference
         log-probs, values, the reward model's score)
      -> the algorithm's advantages -> its train stages (+ each one's sync) -> the vLLM engines' sync
      -> rollouts/step=N.parquet -> the step's statistics

PPO: passes reward/infer, reference/infer, actor/train (old log-probs), critic/infer; GAE; actor and
critic losses. GRPO: reference/infer (with a KL term), actor/train; group advantages; its actor loss.

Boundary: sequencing only; the parts (recording, tasks) are flows/job/step_parts.py's and
flows/job/generation.py's, the maths nereus_core/rl's.
"""

from __future__ import annotations

from typing import Any

from flows.job import generation, step_parts
from flows.job.step_context import StepContext


def run_step(ctx: StepContext) -> tuple[dict[str, Any], list[int]]:
    """One step of the job's algorithm on ``ctx`` (its pool, state, records, step, engines and prompts)
    on the plan in force; returns its statistics (scores, losses, the algorithm's statistics, response
    lengths) and every generated response's length."""
    pool, state, records, step, engines = ctx.pool, ctx.state, ctx.records, ctx.step, ctx.rollout_engines
    cfg, plan, settings = state.config, state.layouts, state.config.algorithm
    algorithm, t_len = settings.entry, cfg.job.response_len
    r, scores = generation.rollout(
        pool, state, records, step, ctx.data.train, group=settings.group_size, engines=engines
    )
    out = step_parts.forward_passes(pool, state, records, step, r, (p.stage for p in algorithm.passes))
    algorithm.fill(r, out, t_len)
    with records.plain(step, state.plan_id, algorithm.name, "advantages", cfg.job.batch_size * t_len):
        algorithm.estimator(r, settings, cfg.ppo)
    objectives = algorithm.train_objectives(cfg.ppo, settings, plan)
    trained = step_parts.train_stages(pool, state, records, step, r, objectives)
    step_parts.sync_engines(pool, state, records, step, engines)
    step_parts.write_rollout(records, state, step, r, scores)
    return step_parts.step_stats(state, step, r, scores, trained), r.lengths.tolist()
