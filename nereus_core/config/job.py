"""Job configuration: frozen pydantic models that validate themselves.

Every default lives here, never at a call site. A bad value raises a
``ConfigError`` whose message is one line naming the field, the value and what
would be valid; the CLI prints that line and exits 2. The model section is
``config.model.py``'s (re-exported here with the rest).

This module knows nothing about files or the environment, but for one thing: a ``model.path``
names a Hugging Face directory whose config.json decides the model's shapes, read when the model
section is validated (``nereus_core.hf.files.imported_section``). Callers pass in the
mapping they read (``config.from_yaml.parse_yaml`` reads YAML text with limits; ``load_config`` in the
CLI reads
the file).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from nereus_core.config.base import (
    ClusterConfig,
    ConfigError,
    CriticConfig,
    TrainerConfig,
    name_error,
    shown,
)
from nereus_core.config.data import (
    DataConfig,
    RewardConfig,
    ValidationConfig,
    job_lengths_from_data,
    sections_problem,
)
from nereus_core.config.errors import one_line
from nereus_core.config.model import LLAMA_3_8B as LLAMA_3_8B
from nereus_core.config.model import ModelConfig
from nereus_core.config.model import RopeScaling as RopeScaling
from nereus_core.config.passes import PassesConfig
from nereus_core.config.rollout import RolloutConfig
from nereus_core.count_task import MIN_VOCAB, TaskSettings
from nereus_core.frozen import Frozen
from nereus_core.hf.files import HFDirError, value_model
from nereus_core.layout import Layout
from nereus_core.plan import MODEL_STAGES, ModelStage, PlanRules, models_for, problems, stages_for
from nereus_core.rl.algorithm import AlgorithmConfig
from nereus_core.rl.ppo import PPOConfig


class ScenarioEvent(Frozen):
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


# What a switch writes as its recovery point (``job.switch_recovery``): ``sync`` every model's state to
# the store, ``async`` staged in host memory and written in the background (PyTorch DCP's
# ``async_save``), ``none`` nothing (the newest complete checkpoint stays the recovery point). The
# runtime's rule, which the cost model prices and the simulated world charges, each by its own constants.
RecoveryMode = Literal["async", "sync", "none"]


def recovery_write(mode: RecoveryMode, *, durable: bool) -> RecoveryMode:
    """What a switch writes: a switch with durable units (or a new world) rehydrates them from a
    checkpoint of the step, so it writes one synchronously whatever the mode; any other writes what
    ``mode`` says."""
    return "sync" if durable else mode


class JobConfig(Frozen):
    """What one run does: its steps, batch, lengths, task, checkpoints, adaptation and scenario (the
    PPO maths' settings are ``ppo``)."""

    steps: int = Field(default=4, ge=1, description="Steps to run.")
    seed: int = Field(default=0, ge=0, description="Seed of data and sampling.")
    batch_size: int = Field(default=8, ge=1, description="Sequences per step (global).")
    prompt_len: int = Field(default=8, ge=1, description="Prompt tokens per sequence.")
    response_len: int = Field(default=8, ge=1, description="Generated tokens per sequence.")
    lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate of the runtime self-check.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    task: Literal["count"] = Field(default="count", description="The task (nereus_core/count_task.py).")
    # verl's trainer.save_freq defaults to -1 (no checkpoint at all) and keeps every one it writes
    # (max_actor_ckpt_to_keep: null); OpenRLHF keeps 3 (--max_ckpt_num). Here a run always has a
    # resume point at most 10 steps old, and the disk holds a bounded number of checkpoints.
    snapshot_every: int = Field(
        default=10,
        ge=0,
        description="Checkpoint every model's state after every K steps, and always at the end (0: only "
        "at the end). A plan switch writes one too.",
    )
    keep_checkpoints: int = Field(
        default=3,
        ge=0,
        description="Complete checkpoints kept in the run directory: the newest N (periodic, switch and "
        "final alike); an older one is deleted once a newer one is complete (0: keep all).",
    )
    verify_transitions: bool = Field(
        default=False,
        description="After every plan switch, check every model's live state bitwise against its digests "
        "taken on the devices before the moves, and the actor's (and critic's) outputs on a probe batch "
        "against plan A's (<= 1e-5).",
    )
    # PyTorch DCP's async_save stages the state in host memory and writes it while training goes on;
    # verl and OpenRLHF write no checkpoint for a switch (they have none: they restart).
    switch_recovery: RecoveryMode = Field(
        default="async",
        description="What a live switch writes before its moves: async (every model's state staged in "
        "host memory, written to the run directory while the job goes on: a checkpoint of the step once "
        "complete), sync (that checkpoint written first), none (nothing: a driver killed mid-switch "
        "resumes from the newest complete checkpoint). A switch that rehydrates anything (a device-set "
        "change, a durable unit) writes the checkpoint first in every mode.",
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


class NereusConfig(Frozen):
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
    ppo: PPOConfig = PPOConfig()
    trainer: TrainerConfig = TrainerConfig()
    plan: dict[ModelStage, Layout] = Field(
        default_factory=dict, description="Initial layout per model-stage, e.g. 'actor/train'."
    )
    data: DataConfig | None = Field(
        default=None, description="Prompt data in verl's format (config.data.py)."
    )
    validation: ValidationConfig | None = Field(
        default=None, description="When to score the validation prompts."
    )
    reward: RewardConfig | None = Field(
        default=None, description="The reward function (rewards/registry.py)."
    )
    critic: CriticConfig = CriticConfig()
    rollout: RolloutConfig = RolloutConfig()
    passes: PassesConfig = PassesConfig()

    @property
    def uses_reward_model(self) -> bool:
        """Whether the score comes from a reward model (the reward/infer stage): PPO's with
        ``reward.model_path`` (verl's reward model: its score is used, the rule only logged), or on the
        count task, fitted to its rule; not GRPO (the rule itself), nor a rule ``reward.function`` on
        text alone (verl's rule rewards)."""
        reward = self.reward
        text_rule = reward is not None and reward.inputs == "text" and reward.model_path is None
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
            models=self.models,
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
    def _check_value_models(self) -> NereusConfig:
        reward_path = self.reward.model_path if self.reward is not None else None
        if reward_path is not None and not self.algorithm.uses_reward_model:
            raise ValueError(
                f"reward.model_path is set but algorithm {self.algorithm.name} scores with "
                "reward.function only; remove reward.model_path or use algorithm ppo"
            )
        try:
            models = self.models
        except HFDirError as err:
            raise ValueError(str(err)) from None
        longest = self.job.prompt_len + self.job.response_len  # the data's lengths when it has data
        for model, key, _ in self._value_dirs():
            if models[model].max_position_embeddings < longest:
                raise ValueError(
                    f"{key}: max_position_embeddings={models[model].max_position_embeddings} is shorter "
                    f"than the job's longest sequence ({longest} tokens); shorten the prompts or responses"
                )
        return self

    @model_validator(mode="after")
    def _check_rollout(self) -> NereusConfig:
        if not self.rollout.uses_vllm:
            return self
        generate = self.plan.get(ModelStage.ACTOR_GENERATE)
        if generate is not None and generate.pp > 1:
            raise ValueError(
                f"plan.actor/generate pp={generate.pp}: rollout.engine=vllm generates without pipeline "
                "stages; use pp=1 (tp and dp as you like) or rollout.engine=nereus"
            )
        return self

    def _value_dirs(self) -> list[tuple[str, str, str]]:
        """(model, config key, directory) of each value model the job reads from its own directory."""
        named = [("critic", "critic.path", self.critic.path)]
        if self.reward is not None:
            named.append(("reward", "reward.model_path", self.reward.model_path))
        return [(model, key, path) for model, key, path in named if path is not None]

    @property
    def models(self) -> dict[str, ModelConfig]:
        """Model -> its config (``plan.models_for`` of ``model``: critic and reward with the value
        head); a critic or reward model read from its own directory (``critic.path``,
        ``reward.model_path``) has that directory's shapes (``hf.files.value_model``). Every part of
        the job that sizes a model asks this. Raises ``HFDirError`` (config load turns it into the
        key's one-line error)."""
        models = models_for(self.model)
        for model, key, path in self._value_dirs():
            role = "critic" if model == "critic" else "reward model"
            try:
                models[model] = _value_model(path, _changed_ns(path), models[model].model_dump_json(), role)
            except HFDirError as err:
                raise HFDirError(f"{key}: {err}") from None
        return models


@functools.lru_cache(maxsize=32)
def _value_model(path: str, changed_ns: int, ours: str, role: str) -> ModelConfig:
    """``hf.files.value_model`` once per directory version (``changed_ns``: its config.json's mtime) and
    job model (``ours`` as JSON): stages ask for their model config on every call."""
    return value_model(path, ModelConfig.model_validate_json(ours), role=role)


def _changed_ns(path: str) -> int:
    try:
        return os.stat(os.path.join(path, "config.json")).st_mtime_ns
    except OSError:
        return -1  # value_model names what is missing


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
