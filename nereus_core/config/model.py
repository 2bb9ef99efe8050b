"""The ``model:`` section: a Llama-style decoder (Llama or Qwen2 numerics), random-init or imported
from a Hugging Face directory (``model.path``: its config.json decides the shapes, read when the
section is validated by ``nereus_core.hf.files.imported_section``), and the precision it trains in."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nereus_core.frozen import Frozen
from nereus_core.hf.files import imported_section

# Sanity bounds on a model's sizes, far past any published model (Llama 3.1 405B: 126 layers, width
# 16384, 128 heads; vocabularies up to 256k; contexts up to 10M), so that a config.json claiming a
# billion layers is refused at load instead of making the memory model walk them. Sizes inside the
# bounds that no device can hold are the memory model's to refuse (``nereus_core.preflight``).
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_SIZE = 1 << 24
MAX_POSITIONS = 1 << 30


class RopeScaling(Frozen):
    """Llama 3's RoPE frequency scaling (Hugging Face ``rope_type: llama3``; Llama-3.1's config.json)."""

    rope_type: Literal["llama3"] = Field(default="llama3", description="Only Llama 3's scaling.")
    factor: float = Field(gt=0, description="Long wavelengths are divided by this.")
    low_freq_factor: float = Field(gt=0, description="Wavelengths past original/low are scaled fully.")
    high_freq_factor: float = Field(gt=0, description="Wavelengths below original/high are kept.")
    original_max_position_embeddings: int = Field(ge=1, description="Context length before scaling.")

    @model_validator(mode="after")
    def _check_band(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )
        return self


class ModelConfig(Frozen):
    """A Llama-style decoder; field names follow Hugging Face ``LlamaConfig`` where one exists."""

    architecture: Literal["LlamaForCausalLM", "Qwen2ForCausalLM"] = Field(
        default="LlamaForCausalLM",
        description="Hugging Face architecture whose names and numerics the model follows.",
    )

    vocab_size: int = Field(default=256, ge=2, le=MAX_SIZE, description="Vocabulary size.")
    hidden_size: int = Field(default=64, ge=2, le=MAX_SIZE, description="Model width.")
    intermediate_size: int = Field(default=128, ge=1, le=MAX_SIZE, description="SwiGLU inner width.")
    num_hidden_layers: int = Field(default=4, ge=1, le=MAX_LAYERS, description="Decoder layers.")
    num_attention_heads: int = Field(default=4, ge=1, le=MAX_HEADS, description="Query heads.")
    num_key_value_heads: int = Field(default=2, ge=1, le=MAX_HEADS, description="Key/value heads (GQA).")
    max_position_embeddings: int = Field(default=256, ge=1, le=MAX_POSITIONS, description="Longest sequence.")
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base.")
    rope_scaling: RopeScaling | None = Field(default=None, description="Llama 3's RoPE scaling, if any.")
    attention_bias: bool = Field(
        default=False, description="Biases on q/k/v projections (Qwen2's; o_proj never has one)."
    )
    rms_norm_eps: float = Field(default=1e-5, gt=0, description="RMSNorm epsilon.")
    tie_word_embeddings: bool = Field(default=False, description="Share lm_head with embed_tokens.")
    head: Literal["lm", "value"] = Field(
        default="lm",
        description=(
            "lm: next-token logits (LlamaForCausalLM, for actor and reference); value: a scalar per "
            "token from score.weight (LlamaForSequenceClassification with one label; critic, reward)."
        ),
    )
    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32",
        description=(
            "Parameters and activations; bf16 trains with fp32 master weights and fp32 AdamW state "
            "(DeepSpeed's bf16 mode). fp16 is refused: it needs loss scaling."
        ),
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Train passes keep only each decoder layer's input and recompute the layer in the "
        "backward pass (verl's model.enable_gradient_checkpointing, OpenRLHF's --gradient_checkpointing): "
        "activations of one layer instead of all, for one more forward of every layer.",
    )
    init_std: float = Field(default=0.02, gt=0, description="Std of the seeded normal init.")
    seed: int = Field(default=0, ge=0, description="Seed of the weights; every rank builds the same.")
    path: str | None = Field(
        default=None,
        description=(
            "A Hugging Face model directory (LlamaForCausalLM or Qwen2ForCausalLM): shapes, architecture, "
            "RoPE, eps and ties come from its config.json, weights from its safetensors (each device reads "
            "its own slices); fields given beside it must be equal. None: seeded random weights."
        ),
    )
    tokenizer: str | None = Field(
        default=None, description="Tokenizer directory (transformers AutoTokenizer); None: model.path."
    )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def tokenizer_dir(self) -> str | None:
        return self.tokenizer or self.path

    @model_validator(mode="before")
    @classmethod
    def _import_path(cls, data: Any) -> Any:
        """With ``path``, the directory's config.json decides the model's shapes (hf_dir reads it)."""
        if not isinstance(data, dict) or (data.get("path") is None and data.get("tokenizer") is None):
            return data
        return imported_section(data, cls)

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        if value == "fp16":
            # fp16 needs dynamic loss scaling, whose scaler state would have to move with every
            # transition and checkpoint; bf16 has fp32's exponent range and needs none.
            raise ValueError(
                "model.dtype=fp16 needs loss scaling, which Nereus does not carry; use bf16 or fp32"
            )
        return value

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; choose heads that divide it"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"model.num_key_value_heads={self.num_key_value_heads}; "
                "GQA needs kv heads that divide the heads"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model.hidden_size/model.num_attention_heads={self.head_dim} is odd; "
                "RoPE needs an even head_dim"
            )
        if self.attention_bias != (self.architecture == "Qwen2ForCausalLM"):
            raise ValueError(
                f"model.attention_bias={self.attention_bias} with model.architecture={self.architecture}: "
                "q/k/v biases are Qwen2's (true exactly for Qwen2ForCausalLM)"
            )
        return self

    def tp_error(self, tp: int, whose: str | None = None) -> str | None:
        """Why ``tp`` cannot shard this model, or None if it can. ``whose``: the model-stage's model
        when its config is not the job's ``model:`` section (a critic or reward model of its own)."""
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
            value = getattr(self, name)
            if value % tp:
                valid = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
                field = self._field(name, whose)
                return f"tp={tp} does not divide {field}={value}{self._source}; valid tp: {valid}"
        return None

    def pp_error(self, pp: int, whose: str | None = None) -> str | None:
        """Why ``pp`` cannot split this model, or None if it can (``whose`` as in ``tp_error``)."""
        if pp > self.num_hidden_layers:
            layers = self._field("num_hidden_layers", whose)
            return f"pp={pp} exceeds {layers}={self.num_hidden_layers}{self._source}; use pp <= layers"
        if self.tie_word_embeddings and self.head == "lm" and pp > 1:
            return (
                f"pp>1 with {self._field('tie_word_embeddings', whose)}=true is not supported yet; "
                "set tie_word_embeddings: false or pp: 1"
            )
        return None

    @staticmethod
    def _field(name: str, whose: str | None) -> str:
        return f"model.{name}" if whose is None else f"the {whose} model's {name}"

    @property
    def _source(self) -> str:
        return f" (from {self.path}/config.json)" if self.path else ""


# Llama-3.1-8B's shapes (Meta's config.json; meta-llama/Meta-Llama-3-8B's published config).
# Llama-3.1 rather than 3.0 only for the 128k context, since the traces' responses pass 8k tokens.
LLAMA_3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)
