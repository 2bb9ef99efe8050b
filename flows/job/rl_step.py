"""One step of the job's algorithm (``algorithm.name``), the same for every entry of the registry
(nereus_core/rl/algorithms.py says what differs: the passes, the estimator, the objectives):

    actor/generate (group_size responses per prompt) -> rule score -> responses cut to the longest
      -> the algorithm's forward passes the plan has (the old log-prob pass reused where the one
         update per batch computes the same: Algorithm.reuses_old_logp)
      -> fill the rollout (old and reference log-probs, values, the reward model's score)
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
from nereus_core.plan import ModelStage
from nereus_core.rl import rollout
from nereus_core.rl.algorithm import AlgorithmConfig


def loss_settings(settings: AlgorithmConfig, max_new_tokens: int) -> AlgorithmConfig:
    """``settings`` with Dr. GRPO's constant (``loss_scale_tokens``; None: the generation's max new
    tokens) given: the rollout's responses are cut to the longest one (``rollout.cut_to_longest``),
    so their width no longer is that constant."""
    if settings.loss_scale_tokens is not None:
        return settings
    return settings.model_copy(update={"loss_scale_tokens": max_new_tokens})


def run_step(ctx: StepContext) -> tuple[dict[str, Any], list[int], list[int]]:
    """One step of the job's algorithm on ``ctx`` (its pool, state, records, step, engines and prompts)
    on the plan in force; returns its statistics (scores, losses, the algorithm's statistics, response
    and prompt lengths), every generated response's length and every prompt's real length."""
    pool, state, records, step, engines = ctx.pool, ctx.state, ctx.records, ctx.step, ctx.rollout_engines
    cfg, plan, settings = state.config, state.layouts, state.config.algorithm
    algorithm = settings.entry
    r, scores = generation.rollout(
        pool, state, records, step, ctx.data.train, group=settings.group_size, engines=engines
    )
    r = rollout.cut_to_longest(r)  # before any pass: the columns after every response's end are pads
    reused = algorithm.reuses_old_logp(cfg.ppo, engine_logp=engines is not None)
    skipped = {ModelStage.ACTOR_TRAIN} if reused else set()
    passes = [p.stage for p in algorithm.passes if p.stage not in skipped]
    out = step_parts.forward_passes(pool, state, records, step, r, passes, reused=skipped)
    algorithm.fill(r, out, r.response_len)
    with records.plain(step, state.plan_id, algorithm.name, "advantages", r.mask.numel()):
        algorithm.estimator(r, settings, cfg.ppo)
    objectives = algorithm.train_objectives(
        cfg.ppo, loss_settings(settings, cfg.job.response_len), plan, old_logp_reused=reused
    )
    trained = step_parts.train_stages(pool, state, records, step, r, objectives)
    step_parts.sync_engines(pool, state, records, step, engines)
    step_parts.write_rollout(records, state, step, r, scores)
    return (
        step_parts.step_stats(state, step, r, scores, trained),
        r.lengths.tolist(),
        r.prompt_lengths.tolist(),
    )
