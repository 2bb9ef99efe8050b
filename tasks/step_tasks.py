"""Prefect tasks of one RL step: one per model-stage, each a thin call into nereus_core on the pool.

Every task returns its plain result and times its model-stages as spans (tasks/spans.py:
``span("reward/infer")``, ``span("actor/train")``, ``sync_span("actor/train")``), which the flow
reads from the recording it opened around the call: it tells the time spent in model-stages from the
orchestration around them and, for the tasks a phased plan runs at once, what overlapped. Rollout
tensors are small (token ids and per-token floats) and stay in the driver; the models' weights never
leave the devices (weight sync moves them device to device).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from safetensors.torch import load_file, save_file

from nereus_core.config import ModelConfig, NereusConfig, PassesConfig
from nereus_core.count_task import make_prompts, rule_score, synthetic_responses
from nereus_core.engine.sampling import SamplingRequest
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.engine.train import score_mse_loss
from nereus_core.layout import Layout
from nereus_core.rl.algorithms import Objective
from nereus_core.rl.ppo import PPOConfig
from nereus_core.rl.rollout import NO_STOP, Rollout, Stopping, minibatch_rows
from tasks import model_ops, rollout_engines
from tasks.reshard import sync_copy
from tasks.runtime.device_pool import DevicePool
from tasks.spans import span


def sync_span(name: str) -> str:
    """The span of the sync that follows train model-stage ``name`` into its inference copy."""
    return f"{name}:sync"


def reward_fit_key(config: NereusConfig) -> str:
    """What the fitted reward model depends on, hashed: model, task, fit settings, seed."""
    parts = {
        "model": config.model.model_dump(mode="json"),
        "task": config.job.task_settings.model_dump(mode="json"),
        "response_lens": list(config.job.response_lens()),
        "batch": config.ppo.reward_fit_batch,
        "steps": config.ppo.reward_fit_steps,
        "lr": config.ppo.reward_fit_lr,
        "seed": config.job.seed,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _fit_cache_key(_: Any, parameters: dict[str, Any]) -> str:
    # The result is a path inside cache_dir: another cache directory is another cache.
    where = hashlib.sha256(str(Path(parameters["cache_dir"]).resolve()).encode()).hexdigest()[:8]
    return f"nereus-reward-fit-{parameters['key']}-{where}"


@task(
    cache_key_fn=_fit_cache_key,
    persist_result=True,
    result_serializer="json",
    retries=1,
)
def fit_reward_model(
    pool: DevicePool, layout: Layout, config: NereusConfig, key: str, cache_dir: str
) -> dict[str, Any]:
    """Fit the reward model (value head) to the task's rule score on synthetic responses; cached by key."""
    value_config = config.model.model_copy(update={"head": "value"})
    settings = OptimizerSettings(lr=config.ppo.reward_fit_lr)
    job, task_settings = config.job, config.job.task_settings
    gen = torch.Generator().manual_seed(job.seed + 17)
    model_ops.load_model(pool, layout, name="reward/fit", config=value_config, optimizer=settings)
    losses = []
    lens = job.response_lens()  # it must score every response length the job will generate
    try:
        for step in range(config.ppo.reward_fit_steps):
            prompts = make_prompts(task_settings, config.ppo.reward_fit_batch, job.seed + 1_000_003, step)
            length = lens[step % len(lens)]
            responses = synthetic_responses(prompts, length, gen, config.model.vocab_size)
            batch = {"ids": torch.cat([prompts, responses], 1), "score": rule_score(prompts, responses)}
            losses.append(
                model_ops.train(
                    pool, layout, batch, name="reward/fit", loss_fn=score_mse_loss, passes=config.passes
                )
            )
        state = model_ops.full_state(pool, layout, name="reward/fit", config=value_config)
    finally:
        model_ops.unload_model(pool, layout, name="reward/fit")
    path = Path(cache_dir) / f"reward-{key}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, path)  # readers never see a half-written file
    return {
        "path": str(path),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
    }


def load_reward_state(path: str) -> dict[str, torch.Tensor]:
    return load_file(path)


@task(cache_policy=NO_CACHE)
def generate(
    pool: DevicePool,
    layout: Layout,
    prompts: torch.Tensor,
    *,
    name: str,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    prompt_mask: torch.Tensor | None = None,
    stopping: Stopping = NO_STOP,
) -> torch.Tensor:
    """actor/generate: sample responses with the KV cache, each stopping at an EOS id or the limit
    (span ``name``)."""
    with span(name):
        return model_ops.sample(
            pool,
            layout,
            prompts,
            name=name,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            prompt_mask=prompt_mask,
            eos_ids=stopping.eos_ids,
            pad_id=stopping.pad_id,
        )


@task(cache_policy=NO_CACHE)
def generate_on_engines(
    pool: DevicePool,
    engines: rollout_engines.Engines,
    prompts: torch.Tensor,
    *,
    request: SamplingRequest,
    prompt_mask: torch.Tensor | None = None,
    group: int = 1,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """actor/generate on vLLM engines (rollout.engine: vllm): responses and vLLM's log-probs of them
    (span ``actor/generate``)."""
    with span("actor/generate"):
        return rollout_engines.generate(
            pool, engines, prompts, request=request, prompt_mask=prompt_mask, group=group, pad_id=pad_id
        )


@task(cache_policy=NO_CACHE)
def sync_engines(pool: DevicePool, engines: rollout_engines.Engines, train: Layout) -> dict[str, float]:
    """actor/train's new weights into every vLLM engine of actor/generate, in place (span
    ``sync_span("actor/train")``); returns the sync's figures (rollout_engines.sync)."""
    with span(sync_span("actor/train")):
        return rollout_engines.sync(pool, engines, train, source="actor/train")


@task(cache_policy=NO_CACHE)
def experience(
    pool: DevicePool,
    layouts: dict[str, Layout],
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    passes: PassesConfig = model_ops.PADDED,
) -> dict[str, torch.Tensor]:
    """The forward passes over the rollout of one slot group in one task, each model-stage its own span:
    ``layouts`` maps the model-stage to run (reward/infer, reference/infer, actor/train for the old
    log-probs, critic/infer) to its layout. One task per slot group instead of one per pass: a task costs
    ~10 ms here, a forward pass of the demo's models ~50 ms (OpenRLHF groups the same passes as
    ``make_experience``); ``passes``: packed or padded (the job's ``passes:`` section). Returns the
    outputs by model-stage."""
    outputs = {}
    for name, layout in layouts.items():
        with span(name):
            outputs[name] = model_ops.forward(
                pool, layout, ids, name=name, attention_mask=attention_mask, passes=passes
            )
    return outputs


def train_epochs(
    pool: DevicePool,
    layout: Layout,
    rollout: Rollout,
    *,
    name: str,
    objective: Objective,
    settings: PPOConfig,
    seed: int,
    passes: PassesConfig = model_ops.PADDED,
) -> dict[str, float]:
    """``settings.ppo_epochs`` passes of optimizer steps over ``settings.mini_batches`` seeded
    mini-batches (of whole groups of ``objective.group_size`` rows) with the loss ``objective``;
    returns its statistics: each the mean over optimizer steps (mini-batches x epochs) of each
    step's mean over micro-batches and replicas (grad_norm is one value per optimizer step)."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(settings.ppo_epochs):
        rows_of = minibatch_rows(rollout.prompts.shape[0], settings.mini_batches, gen, objective.group_size)
        for rows in rows_of:
            batch = rollout.train_batch(rows)
            steps.append(
                model_ops.train_stats(
                    pool,
                    layout,
                    batch,
                    name=name,
                    loss_fn=objective.loss,
                    with_entropy=objective.with_entropy,
                    passes=passes,
                )
            )
    return {key: sum(step[key] for step in steps) / len(steps) for key in objective.keys if key in steps[0]}


@task(cache_policy=NO_CACHE)
def train(
    pool: DevicePool,
    layout: Layout,
    rollout: Rollout,
    *,
    name: str,
    objective: Objective,
    settings: PPOConfig,
    seed: int,
    sync: tuple[Layout, str, ModelConfig] | None = None,
    passes: PassesConfig = model_ops.PADDED,
) -> dict[str, float]:
    """A train model-stage (actor/train or critic/train, the algorithm's ``objective``): epochs over
    shuffled mini-batches (span ``name``), then (``sync``: the inference copy's layout, name and
    config) the new weights into the inference layout (span ``sync_span(name)``); ``passes``: packed
    or padded. Returns the mean loss and statistics over the optimizer steps (``objective.keys``)."""
    with span(name):
        stats = train_epochs(
            pool,
            layout,
            rollout,
            name=name,
            objective=objective,
            settings=settings,
            seed=seed,
            passes=passes,
        )
    if sync is not None:
        dst, dst_name, config = sync
        with span(sync_span(name)):
            sync_inference_copy(pool, layout, dst, src_name=name, dst_name=dst_name, config=config)
    return stats


def sync_inference_copy(
    pool: DevicePool, src: Layout, dst: Layout, *, src_name: str, dst_name: str, config: ModelConfig
) -> None:
    """The inference copy takes the trained parameters device to device (the EMU reshard plan of
    the two layouts; tasks/reshard.py): nothing passes through the driver."""
    sync_copy(pool, config, source=src_name, source_layout=src, copy=dst_name, copy_layout=dst)
