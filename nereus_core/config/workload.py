"""What one RL step asks of every model-stage: sequences, prompt and response lengths, epochs, packing.

Boundary: a value the trace, the controller, the cost model and the simulated world all read; no
formula of any of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import Field, model_validator

from nereus_core.config.job import NereusConfig
from nereus_core.frozen import Frozen


def engine_kv_bytes(config: NereusConfig) -> int:
    """The KV cache one vLLM engine holds on each of its devices (0 with Nereus's sampler): the
    configured ``kv_cache_memory_bytes``, else vLLM's share of the device (``gpu_memory_utilization``;
    it covers the engine's weights too, so this is an upper bound)."""
    rollout = config.rollout
    if not rollout.uses_vllm:
        return 0
    if rollout.kv_cache_memory_bytes is not None:
        return int(rollout.kv_cache_memory_bytes)
    return int(rollout.gpu_memory_utilization * int(config.cluster.memory_per_device))


def _mean_and_high(lengths: Sequence[int], quantile: float) -> tuple[float, int]:
    values = np.asarray(lengths, dtype=float)
    mean = max(float(values.mean()), 1.0)
    return mean, max(math.ceil(float(np.quantile(values, quantile))), math.ceil(mean))


class Workload(Frozen):
    """What one PPO step asks of every model-stage."""

    batch: int = Field(ge=1, description="Sequences per step (global).")
    prompt_len: int = Field(
        ge=1, description="Prompt tokens per sequence (the mean of the real ones once seen)."
    )
    prompt_high: int | None = Field(
        default=None, ge=1, description="Longest prompt in tokens; memory uses it. None takes prompt_len."
    )
    response_mean: float = Field(gt=0, description="Mean response tokens; latency uses it.")
    response_high: int = Field(ge=1, description="High quantile (or max) of response tokens; memory uses it.")
    response_max: int | None = Field(
        default=None,
        ge=1,
        description="Longest response of the step: generation runs until it ends (the slowest replica "
        "holds it); None takes response_high.",
    )
    ppo_epochs: int = Field(default=1, ge=1, description="Passes of the train stages over the batch.")
    mini_batches: int = Field(
        default=1,
        ge=1,
        description="Optimizer steps per epoch of a train stage (batch split this many ways).",
    )
    engine_kv_bytes: int = Field(
        default=0,
        ge=0,
        description="KV cache a rollout engine preallocates on each of its devices and holds for the whole "
        "job (vLLM: rollout.kv_cache_memory_bytes); 0: Nereus's sampler, whose KV cache is sized by the "
        "batch and held only while it generates.",
    )
    pack: bool = Field(
        default=False,
        description="The forward and train passes run packed (``passes.pack``): a micro-batch's activations "
        "are its real tokens, not its rows x the padded length.",
    )
    max_tokens_per_device: int | None = Field(
        default=None,
        ge=1,
        description="Real tokens per micro-batch on one device (``passes.max_tokens_per_device``); None: "
        "the layout's micro_batches equal slices. Needs pack.",
    )

    @model_validator(mode="after")
    def _check(self) -> Workload:
        if self.response_high < self.response_mean:
            raise ValueError(
                f"response_high={self.response_high} is below response_mean={self.response_mean}; "
                "the high quantile must be at least the mean"
            )
        if self.response_max is not None and self.response_max < self.response_high:
            raise ValueError(
                f"response_max={self.response_max} is below response_high={self.response_high}; "
                "the longest response must be at least the high quantile"
            )
        if self.prompt_high is not None and self.prompt_high < self.prompt_len:
            raise ValueError(
                f"prompt_high={self.prompt_high} is below prompt_len={self.prompt_len}; "
                "the longest prompt must be at least the mean"
            )
        if self.max_tokens_per_device is not None and not self.pack:
            raise ValueError(
                f"max_tokens_per_device={self.max_tokens_per_device} needs pack=True "
                "(token-budget micro-batches are packed)"
            )
        return self

    @property
    def prompt_longest(self) -> int:
        """The longest prompt a sequence's memory holds: ``prompt_high``, else ``prompt_len``."""
        return self.prompt_len if self.prompt_high is None else self.prompt_high

    @property
    def response_longest(self) -> int:
        """The longest response generation waits for: ``response_max``, else ``response_high``."""
        return self.response_high if self.response_max is None else self.response_max

    @classmethod
    def from_config(
        cls,
        config: NereusConfig,
        lengths: Sequence[int] = (),
        quantile: float = 0.9,
        prompt_lengths: Sequence[int] = (),
    ) -> Workload:
        """The job's workload: its batch, PPO epochs and mini-batches, the real prompt tokens (mean and
        longest; the config's prompt length until there are any), the response lengths generated (mean
        and ``quantile``; the config's response length until there are any) and how its passes lay out
        their tokens (``passes``)."""
        job, ppo = config.job, config.ppo
        mean, high = (
            _mean_and_high(lengths, quantile) if len(lengths) else (job.response_len, job.response_len)
        )
        prompt, prompt_high = job.prompt_len, None
        if len(prompt_lengths):  # their mean (at least 1) and longest
            mean_prompt, prompt_high = _mean_and_high(prompt_lengths, 1.0)
            prompt = math.ceil(mean_prompt)
        return cls(
            batch=job.batch_size,
            prompt_len=prompt,
            prompt_high=prompt_high,
            response_mean=mean,
            response_high=high,
            response_max=max(max(lengths), high) if len(lengths) else None,
            ppo_epochs=ppo.ppo_epochs,
            mini_batches=ppo.mini_batches,
            engine_kv_bytes=engine_kv_bytes(config),
            pack=config.passes.pack,
            max_tokens_per_device=config.passes.max_tokens_per_device,
        )

    @classmethod
    def from_lengths(
        cls, *, batch: int, prompt_len: int, lengths: Sequence[int], quantile: float = 0.9
    ) -> Workload:
        """Mean and ``quantile`` of observed response lengths (memory then uses the quantile)."""
        if not lengths:
            raise ValueError("lengths is empty; give the observed response lengths")
        mean, high = _mean_and_high(lengths, quantile)
        return cls(
            batch=batch,
            prompt_len=prompt_len,
            response_mean=mean,
            response_high=high,
            response_max=max(max(lengths), high),
        )
