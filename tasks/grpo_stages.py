"""Prefect tasks of a GRPO step that differ from PPO's: the actor's training on group advantages.

Generation and the forward passes (reference, old log-probs) are PPO's tasks (tasks/stages.py);
GRPO has no critic, so no critic pass, training or sync. The loss is ``rollout.grpo_objective``.
"""

from __future__ import annotations

import functools

from prefect import task
from prefect.cache_policies import NO_CACHE

from nereus_core.config import ModelConfig
from nereus_core.layout import Layout
from nereus_core.rl.algorithm import AlgorithmConfig
from nereus_core.rl.ppo import PPOConfig
from nereus_core.rl.rollout import Rollout, grpo_objective
from tasks.runtime.device_pool import DevicePool
from tasks.stages import ACTOR_STATS, sync_inference_copy, timed, train_epochs

# The actor's statistics, as PPO's, plus the KL loss term's estimate (verl's actor/kl_loss).
GRPO_ACTOR_STATS = (*ACTOR_STATS, "kl_loss")


@task(cache_policy=NO_CACHE)
def train_actor(
    pool: DevicePool,
    layout: Layout,
    rollout: Rollout,
    *,
    name: str,
    settings: PPOConfig,
    algorithm: AlgorithmConfig,
    seed: int,
    sync: tuple[Layout, str, ModelConfig] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """actor/train on GRPO's loss: ``settings.ppo_epochs`` passes over ``settings.mini_batches``
    mini-batches of whole groups, then (``sync``: the generation copy's layout, name and config) the
    new weights into the generation layout. Returns ``(stats, timings)`` as ``tasks.stages.train``."""
    objective = functools.partial(grpo_objective, settings=settings, algorithm=algorithm)
    stats, seconds = timed(
        train_epochs,
        pool,
        layout,
        rollout,
        name=name,
        objective=objective,
        keys=GRPO_ACTOR_STATS,
        settings=settings,
        seed=seed,
        with_entropy=True,
        group_size=algorithm.group_size,
    )
    timings = {"train": seconds}
    if sync is not None:
        dst, dst_name, config = sync
        _, timings["sync"] = timed(
            sync_inference_copy, pool, layout, dst, src_name=name, dst_name=dst_name, config=config
        )
    return stats, timings
