"""The phased-plan tests' job: a small PPO job on 4 slots, its phased plan (generation on all four;
the forward passes in two pools, {actor/train's old log-probs, reference/infer} on 0-1 and
{critic/infer, reward/infer} on 2-3; actor/train on 0-1 and critic/train on 2-3 at once) and a
colocated plan of the same job (every stage on all four slots); and the checks on what overlapped.

Each config is a template: a test copies it (``phased_job``) before changing anything."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from nereus_core.layout import Layout
from tests.support.job_configs import SMALL_MODEL

PHASED_PLAN: dict[str, dict[str, Any]] = {
    "actor/generate": {"dp": 4, "devices": [0, 1, 2, 3]},
    "actor/train": {"pp": 2, "devices": [0, 1]},
    "reference/infer": {"devices": [0]},
    "critic/train": {"dp": 2, "devices": [2, 3]},
    "critic/infer": {"dp": 2, "devices": [2, 3]},
    "reward/infer": {"devices": [3]},
}
COLOCATED_PLAN: dict[str, dict[str, Any]] = {
    stage: {"pp": 2, "dp": 2, "devices": [0, 1, 2, 3]} for stage in PHASED_PLAN
}
PHASED_JOB: dict[str, Any] = {
    "name": "phased-test",
    "cluster": {"devices": 4},
    "model": dict(SMALL_MODEL),
    "job": {"steps": 2, "batch_size": 16, "prompt_len": 4, "response_len": 4, "adapt": False},
    "ppo": {"reward_fit_steps": 3, "reward_fit_batch": 8, "ppo_epochs": 1, "mini_batches": 2},
    "plan": PHASED_PLAN,
}


def phased_job(plan: Mapping[str, Any] = PHASED_PLAN, **job: Any) -> dict[str, Any]:
    """A copy of ``PHASED_JOB`` on ``plan``, its ``job`` section updated with ``job``."""
    data = copy.deepcopy(PHASED_JOB) | {"plan": copy.deepcopy(dict(plan))}
    data["job"].update(job)
    return data


def layouts(plan: Mapping[str, Mapping[str, Any]]) -> dict[str, Layout]:
    return {stage: Layout.model_validate(v) for stage, v in plan.items()}


Interval = tuple[float, float]


def intervals(rows: Iterable[Mapping[str, Any]], step: int, stages: Iterable[str]) -> dict[str, Interval]:
    """``model/stage`` -> (start, end) in seconds of the job, from a step's rows of metrics/steps.parquet
    (the stage's own start and its seconds inside its task)."""
    wanted, out = set(stages), {}
    for r in rows:
        key = f"{r['model']}/{r['stage']}"
        if r["step"] == step and key in wanted:
            out[key] = (r["start_s"], r["start_s"] + r["duration_s"])
    assert set(out) == wanted, f"step {step} has no row for {sorted(wanted - set(out))}"
    return out


def overlap(a: Interval, b: Interval) -> float:
    """Seconds two intervals share (0 when they are apart)."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def shared(found: Mapping[str, Interval], pool_a: Iterable[str], pool_b: Iterable[str]) -> float:
    """Seconds the stages of ``pool_a`` ran at the same time as those of ``pool_b``, pair by pair."""
    pool_b = tuple(pool_b)
    return sum(overlap(found[a], found[b]) for a in pool_a for b in pool_b)
