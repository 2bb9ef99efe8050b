"""Job configuration: frozen pydantic models that validate themselves.

Every default lives here, never at a call site. A bad value raises a
``ConfigError`` whose message is one line naming the field, the value and what
would be valid; the CLI prints that line and exits 2.

This module knows nothing about files or the environment, but for one thing: a ``model.path``
names a Hugging Face directory whose config.json decides the model's shapes, read when the model
section is validated (``nereus_core.hf_files.imported_section``). Callers pass in the
mapping they read (``config_yaml.parse_yaml`` reads YAML text with limits; ``load_config`` in the CLI reads
the file).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from nereus_core.algorithm import AlgorithmConfig
from nereus_core.config_base import (
    ClusterConfig,
    ConfigError,
    CriticConfig,
    TrainerConfig,
    _Frozen,
    name_error,
    shown,
)
from nereus_core.config_data import (
    DataConfig,
    RewardConfig,
    ValidationConfig,
    job_lengths_from_data,
    sections_problem,
)
from nereus_core.config_errors import one_line
from nereus_core.hf_files import critic_error, imported_section
from nereus_core.layout import Layout
from nereus_core.plan import MODEL_STAGES, ModelStage, PlanRules, models_for, problems, stages_for
from nereus_core.ppo import PPOSettings
from nereus_core.task import MIN_VOCAB, TaskSettings


class RopeScaling(_Frozen):
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


class ModelConfig(_Frozen):
    """A Llama-style decoder; field names follow Hugging Face ``LlamaConfig`` where one exists."""

    architecture: Literal["LlamaForCausalLM", "Qwen2ForCausalLM"] = Field(
        default="LlamaForCausalLM",
        description="Hugging Face architecture whose names and numerics the model follows.",
    )

    vocab_size: int = Field(default=256, ge=2, description="Vocabulary size.")
    hidden_size: int = Field(default=64, ge=2, description="Model width.")
    intermediate_size: int = Field(default=128, ge=1, description="SwiGLU inner width.")
    num_hidden_layers: int = Field(default=4, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(default=4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(default=2, ge=1, description="Key/value heads (GQA).")
    max_position_embeddings: int = Field(default=256, ge=1, description="Longest sequence.")
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

    def tp_error(self, tp: int) -> str | None:
        """Why ``tp`` cannot shard this model, or None if it can."""
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
            value = getattr(self, name)
            if value % tp:
                valid = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
                source = f" (from {self.path}/config.json)" if self.path else ""
                return f"tp={tp} does not divide model.{name}={value}{source}; valid tp: {valid}"
        return None

    def pp_error(self, pp: int) -> str | None:
        """Why ``pp`` cannot split this model, or None if it can."""
        if pp > self.num_hidden_layers:
            return f"pp={pp} exceeds model.num_hidden_layers={self.num_hidden_layers}; use pp <= layers"
        if self.tie_word_embeddings and self.head == "lm" and pp > 1:
            return (
                "pp>1 with model.tie_word_embeddings=true is not supported yet; "
                "set tie_word_embeddings: false or pp: 1"
            )
        return None


# Llama-3.1-8B's shapes (Meta's config.json; shared/reference/hardware.md "Model (Llama-3-8B)").
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


class ScenarioEvent(_Frozen):
    """Something that happens to a running job before step ``step`` (the demo's scripted changes).

    ``devices``: the pool grows or shrinks to this many slots (a LocalCluster gains or loses
    workers; with an external scheduler, that many workers must be there). ``response_len``:
    responses grow (or shrink) to this many tokens. Either change is re-planned by the controller
    before the step runs, and the job moves its state to the new plan."""

    step: int = Field(ge=1, description="The event takes effect before this step (0-based).")
    devices: int | None = Field(default=None, ge=1, le=4096, description="New number of device slots.")
    response_len: int | None = Field(default=None, ge=1, description="New tokens per response.")

    @model_validator(mode="after")
    def _something(self) -> ScenarioEvent:
        if self.devices is None and self.response_len is None:
            raise ValueError(
                f"job.scenario event at step {self.step} changes nothing; set devices or response_len"
            )
        return self


class JobConfig(_Frozen):
    """What one run does: its steps, batch, lengths, task, checkpoints, adaptation and scenario (the
    PPO maths' settings are ``ppo``)."""

    steps: int = Field(default=4, ge=1, description="Steps to run.")
    seed: int = Field(default=0, ge=0, description="Seed of data and sampling.")
    batch_size: int = Field(default=8, ge=1, description="Sequences per step (global).")
    prompt_len: int = Field(default=8, ge=1, description="Prompt tokens per sequence.")
    response_len: int = Field(default=8, ge=1, description="Generated tokens per sequence.")
    lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate of the runtime self-check.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    task: Literal["count"] = Field(default="count", description="The task (nereus_core/task.py).")
    snapshot_every: int = Field(
        default=0, ge=0, description="Snapshot every model's state every K steps (0: only at the end)."
    )
    verify_transitions: bool = Field(
        default=False,
        description="After every plan switch, check every model's state bitwise against the checkpoint "
        "taken before it, and the actor's (and critic's) outputs on a probe batch against plan A's "
        "(<= 1e-5).",
    )
    adapt: bool = Field(
        default=False,
        description="Ask the controller after every step and switch plans when it admits a transition.",
    )
    profile: Literal["cpu", "h100"] = Field(
        default="cpu", description="Hardware profile the controller's cost model starts from."
    )
    scenario: tuple[ScenarioEvent, ...] = Field(
        default=(),
        description="Scripted changes during the run: devices joining or leaving, longer responses.",
    )

    @model_validator(mode="after")
    def _check_scenario(self) -> JobConfig:
        steps = [e.step for e in self.scenario]
        if steps != sorted(set(steps)):
            raise ValueError(f"job.scenario steps {steps} must be strictly increasing; one event per step")
        return self

    def response_lens(self) -> tuple[int, ...]:
        """Every response length the job will generate, in order of first use."""
        lens = [self.response_len] + [e.response_len for e in self.scenario if e.response_len]
        return tuple(dict.fromkeys(lens))

    @property
    def task_settings(self) -> TaskSettings:
        return TaskSettings(name=self.task, prompt_len=self.prompt_len, response_len=self.response_len)


class NereusConfig(_Frozen):
    """The whole resolved config of a run."""

    name: str = Field(
        default="nereus-run",
        min_length=1,
        description="Run name (a name, not a path: the default run directory is runs/NAME-TIME).",
    )
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    job: JobConfig = JobConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    ppo: PPOSettings = PPOSettings()
    trainer: TrainerConfig = TrainerConfig()
    plan: dict[ModelStage, Layout] = Field(
        default_factory=dict, description="Initial layout per model-stage, e.g. 'actor/train'."
    )
    data: DataConfig | None = Field(
        default=None, description="Prompt data in verl's format (config_data.py)."
    )
    validation: ValidationConfig | None = Field(
        default=None, description="When to score the validation prompts."
    )
    reward: RewardConfig | None = Field(
        default=None, description="The reward function (rewards/registry.py)."
    )
    critic: CriticConfig = CriticConfig()

    @property
    def uses_reward_model(self) -> bool:
        """Whether the score comes from a reward model: PPO's on the count task, fitted to its rule
        (the reward/infer stage); not GRPO (the rule itself), nor a rule ``reward.function`` on text
        (verl's rule rewards)."""
        text_rule = self.reward is not None and self.reward.inputs == "text"
        return self.algorithm.uses_reward_model and not text_rule

    @property
    def stages(self) -> tuple[ModelStage, ...]:
        """The job's model-stages (``plan.stages_for``): every part of the job asks this, not a constant."""
        return stages_for(
            critic=self.algorithm.uses_critic,
            reference=self.algorithm.uses_reference(kl=self.ppo.uses_kl),
            reward_model=self.uses_reward_model,
        )

    def plan_rules(self, devices: int | None = None) -> PlanRules:
        """What every plan of this job must obey (``plan.problems``), on ``devices`` slots (default: the
        cluster's)."""
        return PlanRules(
            models=models_for(self.model),
            devices=self.cluster.devices if devices is None else devices,
            batch=self.job.batch_size,
            mini_batches=self.ppo.mini_batches,
        )

    @model_validator(mode="before")
    @classmethod
    def _lengths_from_data(cls, data: Any) -> Any:
        return job_lengths_from_data(data)  # with a data section, its lengths are the job's

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        problem = name_error(name)
        if problem:
            raise ValueError(f"name={shown(name)}: {problem}")
        return name

    @model_validator(mode="after")
    def _check_plan(self) -> NereusConfig:
        if self.job.batch_size % self.ppo.mini_batches:
            raise ValueError(
                f"job.batch_size={self.job.batch_size} is not divisible by "
                f"ppo.mini_batches={self.ppo.mini_batches}; choose a batch size that is a multiple of it"
            )
        grouping = self.algorithm.batch_error(self.job.batch_size, self.ppo.mini_batches)
        if grouping:
            raise ValueError(grouping)
        extra = [s for s in self.plan if s not in self.stages]
        if extra:
            raise ValueError(
                f"plan.{extra[0]}: algorithm {self.algorithm.name} with these settings has no "
                f"{extra[0]} (its model-stages: {', '.join(self.stages)}); remove it from plan"
            )
        found = problems(self.plan, self.plan_rules())
        if found:
            raise ValueError(f"plan.{found[0]}")
        if self.model.vocab_size < MIN_VOCAB:
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} is too small for job.task={self.job.task!r}; "
                f"use at least {MIN_VOCAB}"
            )
        total = self.job.prompt_len + self.job.response_len
        if self.data is None and total > self.model.max_position_embeddings:  # else data's names
            raise ValueError(
                f"job.prompt_len+job.response_len={total} exceeds "
                f"model.max_position_embeddings={self.model.max_position_embeddings}; "
                "shorten them or raise the limit"
            )
        problem = sections_problem(
            self.data,
            self.validation,
            self.reward,
            max_position_embeddings=self.model.max_position_embeddings,
            tokenizer_dir=self.model.tokenizer_dir,
        )
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_critic(self) -> NereusConfig:
        problem = (
            critic_error(self.critic.path, models_for(self.model)["critic"]) if self.critic.path else None
        )
        if problem:
            raise ValueError(f"critic.path: {problem}")
        return self


def parse_config(data: dict[str, Any] | None) -> NereusConfig:
    """Validate a mapping into a ``NereusConfig``; raise ``ConfigError`` with one line."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(data).__name__}")
    try:
        return NereusConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(" ".join(one_line(err, NereusConfig).splitlines())) from None


def with_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML scalars by the caller)."""
    out: dict[str, Any] = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set job.steps=3")
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"--set {item!r}: the key has an empty part; write it like job.steps")
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
    "CriticConfig",
    "JobConfig",
    "ModelConfig",
    "NereusConfig",
    "TrainerConfig",
    "name_error",
    "parse_config",
    "shown",
    "with_overrides",
]
