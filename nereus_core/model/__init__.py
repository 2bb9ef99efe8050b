"""A Llama-style decoder with Megatron tensor parallelism, split into pipeline stages, with a KV cache."""

from __future__ import annotations

from nereus_core.model.llama import KVCache, LlamaStage
from nereus_core.model.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    reduce_from_tp,
    vocab_parallel_argmax,
    vocab_parallel_logprobs,
    vocab_parallel_sample,
)
from nereus_core.model.weights import (
    hf_config,
    init_full_state,
    shard_dim,
    shard_tensor,
    stage_param_names,
    unshard,
)

__all__ = [
    "ColumnParallelLinear",
    "KVCache",
    "LlamaStage",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "hf_config",
    "init_full_state",
    "reduce_from_tp",
    "shard_dim",
    "shard_tensor",
    "stage_param_names",
    "unshard",
    "vocab_parallel_argmax",
    "vocab_parallel_logprobs",
    "vocab_parallel_sample",
]
