"""Full weights by Hugging Face name, and the tensor-parallel shard map over them.

The shard map is Megatron-LM's (Shoeybi et al., 2019, arXiv:1909.08053):
column-parallel projections (q, k, v, gate, up; with Qwen2's q/k/v biases) and the
vocab-parallel embedding and lm_head split dim 0 (output rows); row-parallel projections
(o_proj, down_proj) split dim 1 (input columns); norms are replicated. Every
split is an equal contiguous chunk, so the local shard of rank ``r`` out of
``tp`` is chunk ``r``. Because q/k/v rows are ordered head by head, a chunk of
rows is a run of whole heads: rank ``r`` holds query heads
``[r*H/tp, (r+1)*H/tp)`` and the kv heads they read (GQA groups stay whole).

Nothing here knows about processes: these are pure functions of the config.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from nereus_core.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from nereus_core.layout import Layout

_COLUMN = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "q_proj.bias",
    "k_proj.bias",
    "v_proj.bias",
)
_ROW = ("o_proj.weight", "down_proj.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
SCORE = "score.weight"  # the value head, as in HF LlamaForSequenceClassification (num_labels=1)


def layer_param_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF names and full shapes of one decoder layer's parameters, in HF order."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    p = f"model.layers.{layer}.self_attn."
    shapes: dict[str, tuple[int, ...]] = {}
    for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
        shapes[p + proj + ".weight"] = (out, h)
        if config.attention_bias:
            shapes[p + proj + ".bias"] = (out,)
    p = f"model.layers.{layer}."
    return {
        **shapes,
        p + "self_attn.o_proj.weight": (h, q_out),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names and full shapes of every parameter of ``config.architecture``, in HF order."""
    shapes: dict[str, tuple[int, ...]] = {EMBED: (config.vocab_size, config.hidden_size)}
    for layer in range(config.num_hidden_layers):
        shapes.update(layer_param_shapes(config, layer))
    shapes[FINAL_NORM] = (config.hidden_size,)
    if config.head == "value":
        shapes[SCORE] = (1, config.hidden_size)
    elif not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.vocab_size, config.hidden_size)
    return shapes


def ties_embeddings(config: ModelConfig) -> bool:
    """Whether lm_head shares embed_tokens' weight (only an lm head can)."""
    return config.tie_word_embeddings and config.head == "lm"


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


PARAM_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def param_dtype(config: ModelConfig) -> torch.dtype:
    """The torch dtype of the model's parameters and activations (``model.dtype``)."""
    return PARAM_DTYPES[config.dtype]


def init_full_state(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Seeded weights with HF names in ``param_dtype(config)``: normal(0, init_std) matrices and
    biases, norms 1.0; same on every process. Drawn in fp32 and rounded, so every dtype starts
    from the same numbers."""
    generator = torch.Generator(device="cpu").manual_seed(config.seed)
    dtype = param_dtype(config)
    state: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(config).items():
        if is_norm(name):
            state[name] = torch.ones(shape, dtype=dtype)
        else:
            state[name] = torch.empty(shape).normal_(0.0, config.init_std, generator=generator).to(dtype)
    return state


def shard_dim(name: str) -> int | None:
    """The tensor dim split under TP: 0 column/vocab-parallel, 1 row-parallel, None replicated."""
    if name in _VOCAB or name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    if is_norm(name) or name == SCORE:
        return None
    raise KeyError(
        f"{name!r} is not a parameter name of LlamaForCausalLM or Qwen2ForCausalLM (Hugging Face names)"
    )


def head_layers(config: ModelConfig) -> float:
    """The head's matmul parameters in decoder layers' worth (its compute weight in a pipeline split)."""
    head = config.hidden_size if config.head == "value" else config.vocab_size * config.hidden_size
    layer = sum(math.prod(shape) for shape in layer_param_shapes(config, 0).values())
    return head / layer


def stage_layers(config: ModelConfig, layout: Layout, pp_rank: int) -> range:
    """The decoder layers pipeline stage ``pp_rank`` of ``layout`` holds (``Layout.stage_layers`` with
    this model's head weight)."""
    return layout.stage_layers(config.num_hidden_layers, pp_rank, head_layers=head_layers(config))


def stage_param_names(config: ModelConfig, layers: range, first: bool, last: bool) -> list[str]:
    """HF names held by one pipeline stage: embed on the first, final norm and lm_head on the last."""
    if ties_embeddings(config) and first != last:
        raise ValueError(
            "tie_word_embeddings=true needs one stage holding both ends (first and last); "
            "set tie_word_embeddings: false or pp: 1"
        )
    if layers.step != 1 or layers.start < 0 or layers.stop > config.num_hidden_layers:
        raise ValueError(f"layers={layers} is not a contiguous run inside 0..{config.num_hidden_layers - 1}")
    names = [EMBED] if first else []
    for layer in layers:
        names.extend(layer_param_shapes(config, layer))
    if last:
        names.append(FINAL_NORM)
        if config.head == "value":
            names.append(SCORE)
        elif not config.tie_word_embeddings:
            names.append(LM_HEAD)
    return names


def shard_tensor(full: torch.Tensor, name: str, tp_rank: int, tp: int) -> torch.Tensor:
    """A contiguous clone of rank ``tp_rank``'s shard of the full tensor ``name``."""
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank={tp_rank} is outside 0..{tp - 1}")
    dim = shard_dim(name)
    if dim is None or tp == 1:
        return full.detach().clone()
    size = full.shape[dim]
    if size % tp:
        raise ValueError(f"{name}: dim {dim} of size {size} does not split into tp={tp} equal shards")
    part = size // tp
    return full.detach().narrow(dim, tp_rank * part, part).clone()


def shard_slices(name: str, shape: tuple[int, ...], tp_rank: int, tp: int) -> tuple[slice, ...]:
    """Index of rank ``tp_rank``'s shard inside the full tensor ``name`` of ``shape`` (for sliced reads)."""
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank={tp_rank} is outside 0..{tp - 1}")
    index = [slice(None)] * len(shape)
    dim = shard_dim(name)
    if dim is None or tp == 1:
        return tuple(index)
    if shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of size {shape[dim]} does not split into tp={tp} equal shards")
    part = shape[dim] // tp
    index[dim] = slice(tp_rank * part, (tp_rank + 1) * part)
    return tuple(index)


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from all tp shards in tp-rank order (replicated names: the first shard)."""
    if not shards:
        raise ValueError(f"{name}: no shards given")
    dim = shard_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    return torch.cat(shards, dim=dim)


def _rope_parameters(config: ModelConfig) -> dict[str, float | int | str]:
    """Hugging Face's ``rope_parameters`` of the same RoPE (theta, and Llama 3's scaling if any)."""
    if config.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    return {**config.rope_scaling.model_dump(), "rope_theta": config.rope_theta}


def hf_config(config: ModelConfig) -> PretrainedConfig:
    """The ``transformers`` config (``LlamaConfig`` or ``Qwen2Config``) of the same model (tests, export)."""
    from transformers import LlamaConfig, Qwen2Config

    common = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": _rope_parameters(config),
        "tie_word_embeddings": ties_embeddings(config),
        "num_labels": 1,
        "initializer_range": config.init_std,
        "dtype": str(param_dtype(config)).removeprefix("torch."),  # what an export's weights are in
        # Nereus models have no tokenizer: no special ids, so HF generate never stops early.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if config.architecture == "Qwen2ForCausalLM":
        return Qwen2Config(**common, use_sliding_window=False)
    return LlamaConfig(**common, head_dim=config.head_dim, attention_bias=False, mlp_bias=False)
