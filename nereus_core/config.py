"""Job configuration: frozen pydantic models that validate themselves.

Every default lives here, never at a call site. A bad value raises a
``ConfigError`` whose message is one line naming the field, the value and what
would be valid; the CLI prints that line and exits 2.

This module knows nothing about files or the environment: callers pass in the
mapping they read (see ``load_config`` in the CLI).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, model_validator

from nereus_core.layout import MODEL_STAGES, Layout, ModelStage


class ConfigError(ValueError):
    """A configuration value is invalid; ``str(err)`` is the one line to show the user."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ClusterConfig(_Frozen):
    """The device pool: how many device slots and how much memory each has."""

    devices: int = Field(default=2, ge=1, le=4096, description="Device slots in the pool.")
    memory_per_device: ByteSize = Field(
        default=ByteSize(2 * 1024**3),
        gt=0,
        description="Memory capacity of one device slot, e.g. '2GiB' or bytes.",
    )
    scheduler_address: str | None = Field(
        default=None,
        description="An existing Dask scheduler (tcp://host:port); None starts a LocalCluster.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="torch.distributed backend; auto picks nccl on CUDA, gloo otherwise."
    )


class ModelConfig(_Frozen):
    """A Llama-style decoder; field names follow Hugging Face ``LlamaConfig`` where one exists."""

    vocab_size: int = Field(default=256, ge=2, description="Vocabulary size.")
    hidden_size: int = Field(default=64, ge=2, description="Model width.")
    intermediate_size: int = Field(default=128, ge=1, description="SwiGLU inner width.")
    num_hidden_layers: int = Field(default=4, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(default=4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(default=2, ge=1, description="Key/value heads (GQA).")
    max_position_embeddings: int = Field(default=256, ge=1, description="Longest sequence.")
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base.")
    rms_norm_eps: float = Field(default=1e-5, gt=0, description="RMSNorm epsilon.")
    tie_word_embeddings: bool = Field(default=False, description="Share lm_head with embed_tokens.")
    init_std: float = Field(default=0.02, gt=0, description="Std of the seeded normal init.")
    seed: int = Field(default=0, ge=0, description="Seed of the weights; every rank builds the same.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; choose heads that divide it"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; GQA needs kv heads that divide the heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd; RoPE needs an even head_dim")
        return self

    def tp_error(self, tp: int) -> str | None:
        """Why ``tp`` cannot shard this model, or None if it can."""
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
            value = getattr(self, name)
            if value % tp:
                valid = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
                return f"tp={tp} does not divide model.{name}={value}; valid tp: {valid}"
        return None

    def pp_error(self, pp: int) -> str | None:
        """Why ``pp`` cannot split this model, or None if it can."""
        if pp > self.num_hidden_layers:
            return f"pp={pp} exceeds model.num_hidden_layers={self.num_hidden_layers}; use pp <= layers"
        if self.tie_word_embeddings and pp > 1:
            return (
                "pp>1 with model.tie_word_embeddings=true is not supported yet; "
                "set tie_word_embeddings: false or pp: 1"
            )
        return None


class JobConfig(_Frozen):
    """What one run does (the PPO fields arrive with the PPO job)."""

    steps: int = Field(default=4, ge=1, description="Steps to run.")
    seed: int = Field(default=0, ge=0, description="Seed of data and sampling.")
    batch_size: int = Field(default=8, ge=1, description="Sequences per step (global).")
    prompt_len: int = Field(default=8, ge=1, description="Prompt tokens per sequence.")
    response_len: int = Field(default=8, ge=1, description="Generated tokens per sequence.")
    lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")


class NereusConfig(_Frozen):
    """The whole resolved config of a run."""

    name: str = Field(default="nereus-run", min_length=1, description="Run name.")
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    job: JobConfig = JobConfig()
    plan: dict[ModelStage, Layout] = Field(
        default_factory=dict, description="Initial layout per model-stage, e.g. 'actor/train'."
    )

    @model_validator(mode="after")
    def _check_plan(self) -> NereusConfig:
        for stage, layout in self.plan.items():
            for problem in (
                self.model.tp_error(layout.tp),
                self.model.pp_error(layout.pp),
                layout.devices_error(self.cluster.devices),
            ):
                if problem:
                    raise ValueError(f"plan.{stage}: {problem}")
            if (self.job.batch_size % (layout.dp * layout.micro_batches)) != 0:
                raise ValueError(
                    f"plan.{stage}: job.batch_size={self.job.batch_size} is not divisible by "
                    f"dp*micro_batches={layout.dp * layout.micro_batches}; "
                    "choose a batch size that is a multiple of it"
                )
        total = self.job.prompt_len + self.job.response_len
        if total > self.model.max_position_embeddings:
            raise ValueError(
                f"job.prompt_len+job.response_len={total} exceeds "
                f"model.max_position_embeddings={self.model.max_position_embeddings}; "
                "shorten them or raise the limit"
            )
        return self


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"{loc}: unknown field; remove it or check its spelling"
    if first["type"].startswith("missing"):
        return f"{loc}: required field is missing"
    shown = first.get("input")
    if loc and not isinstance(shown, dict):
        return f"{loc}={shown!r}: {msg}"
    return f"{loc}: {msg}" if loc else msg


def parse_config(data: dict[str, Any] | None) -> NereusConfig:
    """Validate a mapping into a ``NereusConfig``; raise ``ConfigError`` with one line."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(data).__name__}")
    try:
        return NereusConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def with_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML scalars by the caller)."""
    out: dict[str, Any] = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set job.steps=3")
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return out


__all__ = [
    "MODEL_STAGES",
    "ClusterConfig",
    "ConfigError",
    "JobConfig",
    "ModelConfig",
    "NereusConfig",
    "parse_config",
    "with_overrides",
]
