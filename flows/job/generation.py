"""Generation on actor/generate from a prompt source: a step's rollout, and validation.

    rollout:    source.batch(step) (x group_size for GRPO) -> actor/generate (sampled, stop ids,
                prompt mask; Nereus's sampler, or vLLM's engines with their log-probs) -> response mask
                -> source.score (the rule: count's on ids, or reward.function on decoded text)
    validate:   every validation batch -> actor/generate (greedy) -> source.score
                -> mean per data source, under verl's names (val-core/<data_source>/reward/mean@1)

Boundary: the flow's side of generation (timing, what is recorded); prompts and scoring are the
source's (nereus_core/prompt_source.py), the model-stage tasks tasks/step_tasks.py's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from prefect import get_run_logger

from flows.job.records import JobRecords
from nereus_core import job, prompt_source
from nereus_core.config.data import ValidationConfig
from nereus_core.engine.sampling import SamplingRequest
from nereus_core.plan import ModelStage
from nereus_core.rl.rollout import Rollout, Stopping, response_mask
from tasks import rollout_engines, spans, step_tasks
from tasks.runtime.device_pool import DevicePool


def _generate(
    pool: DevicePool,
    state: job.JobState,
    batch: prompt_source.PromptBatch,
    stopping: Stopping,
    *,
    temperature: float,
    seed: int,
    group: int = 1,
    engines: rollout_engines.Engines | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Responses and the engine's log-probs of them (vLLM's; None from Nereus's sampler); the task
    times itself as the span ``actor/generate``."""
    max_new = state.config.job.response_len
    if engines is not None:
        request = SamplingRequest(
            max_new_tokens=max_new, temperature=temperature, stop_ids=stopping.eos_ids, seed=seed
        )
        responses, logp = step_tasks.generate_on_engines(
            pool,
            engines,
            batch.prompts,
            request=request,
            prompt_mask=batch.prompt_mask,
            group=group,
            pad_id=stopping.pad_id,
        )
        return responses, logp
    responses = step_tasks.generate(
        pool,
        state.layouts[ModelStage.ACTOR_GENERATE],
        batch.prompts,
        name="actor/generate",
        max_new_tokens=max_new,
        prompt_mask=batch.prompt_mask,
        stopping=stopping,
        temperature=temperature,
        seed=seed,
    )
    return responses, None


def rollout(
    pool: DevicePool,
    state: job.JobState,
    records: JobRecords,
    step: int,
    source: prompt_source.PromptSource,
    *,
    group: int = 1,
    engines: rollout_engines.Engines | None = None,
) -> tuple[Rollout, prompt_source.Scores]:
    """Step ``step``'s prompts (each ``group`` times, copies side by side: GRPO's groups), their
    sampled responses and masks (one generator per replica: every row, copies of one prompt included,
    draws its own tokens), and the rule's scores (``rule_score``; a reward function that raises fails
    the step here, before any training). ``engines``: vLLM's (rollout.engine: vllm), whose log-probs
    the rollout keeps as ``rollout_logp``."""
    cfg, pid = state.config, state.plan_id
    batch, stopping = source.batch(step).repeated(group), source.stopping
    with records.phase("generate"), records.task_call(step, pid) as call, spans.recording() as log:
        seed = cfg.job.seed * 7919 + step
        responses, logp = _generate(
            pool,
            state,
            batch,
            stopping,
            temperature=cfg.ppo.temperature,
            seed=seed,
            group=group,
            engines=engines,
        )
        mask = response_mask(responses, stopping.eos_ids)
        call.add("actor", "generate", int(mask.sum()), log["actor/generate"].seconds)
    r = Rollout(prompts=batch.prompts, responses=responses, mask=mask, prompt_mask=batch.prompt_mask)
    r.rollout_logp = None if logp is None else logp * mask
    with records.plain(step, pid, "task", "rule_score", batch.prompts.shape[0]):
        scores = source.score(batch, responses, mask)
    r.rule_score = scores.score
    return r, scores


def rollout_columns(r: Rollout, scores: prompt_source.Scores) -> dict[str, Any]:
    """What ``rollouts/step=N.parquet`` keeps: the rollout's tensors, lengths and decoded responses."""
    return {**r.columns(), **({"response_text": list(scores.texts)} if scores.texts is not None else {})}


def val_key(data_source: str) -> str:
    """verl's name of a data source's validation score (``process_validation_metrics``: mean of one
    greedy sample per prompt)."""
    return f"val-core/{data_source}/reward/mean@1"


def validate(
    pool: DevicePool,
    state: job.JobState,
    source: prompt_source.DatasetSource,
    engines: rollout_engines.Engines | None = None,
) -> dict[str, float]:
    """Greedy responses to every validation prompt, scored; the mean per data source under
    ``val_key``, and ``val_s`` (the seconds it took)."""
    start, scored = time.perf_counter(), []
    for batch in source.val_batches():
        responses, _ = _generate(
            pool, state, batch, source.stopping, temperature=0.0, seed=0, engines=engines
        )
        mask = response_mask(responses, source.stopping.eos_ids)
        scored.append((batch, source.score(batch, responses, mask)))
    out: dict[str, float] = {val_key(k): v for k, v in prompt_source.mean_by_source(scored).items()}
    out["val_s"] = time.perf_counter() - start
    get_run_logger().info(
        "validation: %s (%d prompts, %.1f s)",
        ", ".join(f"{k} {v:.4f}" for k, v in out.items() if k != "val_s"),
        source.sampler.size,
        out["val_s"],
    )
    return out


def validation_due(step: int, steps: int, validation: ValidationConfig | None) -> bool:
    """After step ``step`` (0-based): every ``validation.every`` steps and after the last one, as
    verl's ``test_freq`` (its steps count from 1)."""
    every = validation.every if validation is not None else 0
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)
