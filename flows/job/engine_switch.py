"""actor/generate's vLLM engines in a running job (``rollout.engine: vllm``), across plan switches.

    start:   engines on actor/generate's layout (one per replica, tp = its tp) <- actor/train's weights
    switch:  actor/generate's degrees or devices change (``transition_cost.engines_rebuilt``)
             -> probe the engines in force (a fixed greedy batch) -> the transition moves the state
             -> the old engines stop, new ones start on the new layout and take actor/train's weights
             from its new layout -> the same probe; verified when every token both sets agree on has
             the same log-prob (``PROBE_TOLERANCE`` of the model's dtype)
             anything else changes -> the engines keep running (the step's sync gives them the weights)

Boundary: the flow's side (when engines are rebuilt, what is recorded); starting, syncing and asking
the engines is tasks/rollout_engines.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from prefect import get_run_logger

from nereus_core import job
from nereus_core.engine.sampling import SamplingRequest
from nereus_core.layout import Layout
from nereus_core.plan import ModelStage
from tasks import rollout_engines
from tasks.runtime.device_pool import DevicePool

GENERATE, TRAIN = ModelStage.ACTOR_GENERATE, ModelStage.ACTOR_TRAIN
PROBE_ROWS, PROBE_TOKENS = 4, 8
# The log-prob gap by which two engine sets still agree, by model dtype: in fp32 engines of different
# tp degrees differ by the rounding of their split matmuls (5e-7 measured); in bf16 each rounds to 8
# bits of mantissa in its own order (0.03 measured against transformers: tests/tasks/runtime/
# test_vllm_engine.py); a stale or misnamed weight is off by far more (0.76 on average).
PROBE_TOLERANCE = {"fp32": 2e-4, "bf16": 0.1}


class JobEngines:
    """The engines in force (``current``), started, rebuilt and stopped by the job flow."""

    def __init__(self, pool: DevicePool, state: job.JobState) -> None:
        self.pool = pool
        self.current: rollout_engines.Engines | None = None
        cfg = state.config
        self._settings = cfg.rollout
        self._max_len = cfg.job.prompt_len + cfg.job.response_len
        self._seed = cfg.job.seed
        self._model = job.model_config(cfg, GENERATE)
        vocab = self._model.vocab_size
        width = cfg.job.prompt_len
        self._probe = (torch.arange(PROBE_ROWS * width).view(PROBE_ROWS, width) * 7 + 1) % vocab
        self._request = SamplingRequest(max_new_tokens=min(PROBE_TOKENS, cfg.job.response_len))

    def start(self, layouts: Mapping[str, Layout]) -> float:
        """Engines on actor/generate's layout in ``layouts``, given actor/train's weights from its
        layout there; the slowest engine's start seconds."""
        layout = layouts[GENERATE]
        self.current, seconds = rollout_engines.start(
            self.pool,
            layout,
            name=str(GENERATE),
            config=self._model,
            settings=self._settings,
            max_model_len=self._max_len,
            seed=self._seed,
        )
        synced = rollout_engines.sync(self.pool, self.current, layouts[TRAIN], source=str(TRAIN))
        get_run_logger().info(
            "vLLM engines of actor/generate on %s started in %s s, actor/train's weights in %.2f s",
            layout.key,
            ", ".join(f"{s:.1f}" for s in seconds),
            synced["seconds"],
        )
        return max(seconds)

    def stop(self) -> None:
        if self.current is not None:
            engines, self.current = self.current, None
            rollout_engines.stop(self.pool, engines)

    def probe(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The engines' greedy responses to the fixed probe prompts and their log-probs."""
        assert self.current is not None
        return rollout_engines.generate(self.pool, self.current, self._probe, request=self._request)

    def rebuild(
        self, layouts: Mapping[str, Layout], before: tuple[torch.Tensor, torch.Tensor]
    ) -> dict[str, Any]:
        """Stop the engines in force, start them on the plan ``layouts`` (the switch has committed)
        and compare the probe with ``before`` (the old engines' answer)."""
        t = time.perf_counter()
        try:
            self.stop()
        except Exception as err:  # a worker the switch retired took its engine process with it
            get_run_logger().warning("the old vLLM engines did not stop cleanly: %s", err)
            self.current = None
        started = self.start(layouts)
        after = self.probe()
        stats = {"engine_rebuild_s": time.perf_counter() - t, "engine_start_s": started}
        return {**stats, **probe_agreement(before, after, PROBE_TOLERANCE[self._model.dtype])}


def probe_agreement(
    before: tuple[torch.Tensor, torch.Tensor], after: tuple[torch.Tensor, torch.Tensor], tolerance: float
) -> dict[str, Any]:
    """How two engine sets answered the same greedy probe: the share of tokens where both chose the
    same token after the same prefix, the largest log-prob gap over those, and whether the rebuild is
    verified (at least one shared token per row, every gap within ``tolerance``)."""
    (ids_a, logp_a), (ids_b, logp_b) = before, after
    same_bt = (ids_a == ids_b).long().cumprod(dim=1).bool()  # the prefix both sets agree on
    gap = float(((logp_a - logp_b).abs() * same_bt).max()) if same_bt.any() else float("inf")
    return {
        "engine_probe_agreed": float(same_bt.float().mean()),
        "engine_probe_logp_diff_max": gap,
        "engine_verified": bool(same_bt[:, 0].all()) and gap <= tolerance,
    }


@contextmanager
def engines_of(pool: DevicePool, state: job.JobState) -> Iterator[JobEngines | None]:
    """With ``rollout.engine: vllm``: the job's engines, started on its plan and stopped when the run
    ends; else None (Nereus's sampler)."""
    if not state.config.rollout.uses_vllm:
        yield None
        return
    engines = JobEngines(pool, state)
    try:
        engines.start(state.layouts)
        yield engines
    finally:
        engines.stop()
