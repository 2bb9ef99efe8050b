"""The ``data``, ``validation`` and ``reward`` sections of the config (verl's ``data.*``,
``trainer.test_freq``/``val_before_train`` and ``reward_model``/``custom_reward_function``).

All three are optional: a config without them runs the demo's ``count`` task as before. Files are
checked when the config is loaded (a data file or reward model that does not exist, a reward
function that cannot be imported: tried in a short-lived worker process, never in this one), each
refused in one line before anything starts. Paths are relative to where ``nereus`` runs.

Boundary: leaf definitions that ``nereus_core.config`` adds to the whole config; reading the data
is ``storage/datasets.py`` and calling rewards ``nereus_core.rewards``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import ByteSize, Field, field_validator, model_validator

from nereus_core.config.base import shown
from nereus_core.frozen import Frozen
from nereus_core.hf.tokenizer import chat_template_error
from nereus_core.rewards import registry
from nereus_core.rewards.isolation import WorkerSettings

DATA_SUFFIXES = (".parquet", ".jsonl")
WORKER = WorkerSettings()  # the reward worker's defaults: one owner, nereus_core.rewards.isolation
DEFAULT_TIMEOUT_S = WORKER.timeout_s


def _file_problem(path: str) -> str | None:
    """Why ``path`` is not a readable data file, or None."""
    if not path.endswith(DATA_SUFFIXES):
        return f"{shown(path)} is not a .parquet or .jsonl file; verl's data sets are Parquet (or JSONL)"
    where = Path(path)
    if where.is_dir():
        return f"{shown(path)} is a directory; name the .parquet or .jsonl file(s) in it"
    if not where.is_file():
        return (
            f"{shown(path)} does not exist; make it with nereus data gsm8k|math500 --out DIR, or fix the path"
        )
    return None


def _files(value: Any) -> Any:
    return (value,) if isinstance(value, str) else value  # data.train_files=x.parquet, as verl takes


def _check_files(files: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(files)) != len(files):
        raise ValueError(f"{shown(list(files))} names a file twice; name each once")
    for i, path in enumerate(files):
        problem = _file_problem(path)
        if problem:
            raise ValueError(f"file {i}: {problem}")
    return files


class DataConfig(Frozen):
    """Prompt data in verl's format and how the job reads it (``nereus_core.dataset``)."""

    train_files: tuple[str, ...] = Field(
        min_length=1, description="Parquet or JSONL files of training prompts, read in this order."
    )
    val_files: tuple[str, ...] = Field(
        default=(), description="Files of validation prompts (none: no validation)."
    )
    max_prompt_length: int = Field(
        default=512, ge=1, le=1_048_576, description="Most tokens of a chat prompt."
    )
    max_response_length: int = Field(
        default=512, ge=1, le=1_048_576, description="Most tokens generated per prompt."
    )
    truncation: Literal["filter", "error"] = Field(
        default="filter",
        description="A prompt over max_prompt_length: filter drops it (counted in one log line, as verl's "
        "filter_overlong_prompts); error refuses the data set.",
    )
    max_rows: int = Field(
        default=500_000,
        ge=1,
        description="Most rows of a split, over its files. Every prompt is rendered and held from the "
        "start (tens of microseconds and a few hundred bytes a row), so a larger split is refused before "
        "its rows are read (a Parquet file by its metadata); files are read in batches, never whole.",
    )
    shuffle: bool = Field(default=True, description="Shuffle the training prompts anew each epoch.")
    seed: int = Field(default=0, ge=0, description="Seed of the shuffle: the same seed gives the same order.")

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return _files(value)

    @field_validator("train_files", "val_files")
    @classmethod
    def _exist(cls, files: tuple[str, ...]) -> tuple[str, ...]:
        return _check_files(files)


class ValidationConfig(Frozen):
    """When the job scores the validation prompts (verl's ``trainer.test_freq``, ``val_before_train``)."""

    every: int = Field(default=0, ge=0, description="Validate every N steps; 0: never during training.")
    before_train: bool = Field(default=False, description="Validate once before the first step.")
    batch_size: int | None = Field(
        default=None, ge=1, description="Prompts per validation batch; none: all in one batch."
    )


class RewardConfig(Frozen):
    """Which function scores a response (``nereus_core.rewards.registry``), how a user's function's
    worker process runs (``nereus_core.rewards.isolation``), and a reward model."""

    function: str = Field(
        default="count",
        min_length=1,
        description="gsm8k, gsm8k_flexible, math, count, or path/to/file.py:function with verl's "
        "signature (data_source, solution_str, ground_truth, extra_info) -> float | dict. A file is "
        "imported only in a worker process of its own, at config load (to check it) and in the job.",
    )
    timeout_s: float = Field(
        default=WORKER.timeout_s,
        gt=0,
        le=3600,
        description="Seconds a path/to/file.py:function reward may take on one response. The function "
        "runs in a worker process of its own: past this limit (or if it exits) the worker is ended and "
        "the step fails in one line naming the function and the row; the last checkpoint stays the "
        "resume point. Built-in rewards run in the driver.",
    )
    load_timeout_s: float = Field(
        default=WORKER.load_timeout_s,
        gt=0,
        le=3600,
        description="Seconds a path/to/file.py:function reward's worker may take to start and import the "
        "file (at config load and at each worker start): a file that hangs at import is refused then.",
    )
    max_memory: ByteSize = Field(
        default=ByteSize(WORKER.max_memory),
        ge=256 * 2**20,
        description="Address space of the reward worker (RLIMIT_AS): an allocation past it raises "
        "MemoryError in the worker, never in the driver. Raise it for a file that imports large "
        "libraries (CUDA builds of torch map many GiB).",
    )
    max_cpu_s: int = Field(
        default=WORKER.max_cpu_s,
        ge=1,
        le=7 * 86400,
        description="CPU seconds one reward worker process may use (RLIMIT_CPU; the kernel ends it "
        "past them). A worker past half of them is replaced after its call, so steady use never "
        "reaches the limit; a runaway import or call does.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Variables set in the reward worker's environment, which holds nothing else of the "
        "driver's but PATH, HOME, LANG, LC_ALL, LC_CTYPE, TZ, TMPDIR and reward.pass_env. Stored in the "
        "run's config.yaml: pass secrets with pass_env instead.",
    )
    pass_env: tuple[str, ...] = Field(
        default=(),
        description="Names of the driver's environment variables copied into the reward worker's "
        "(those not set are left out), e.g. [OPENAI_API_KEY] for a judge.",
    )
    model_path: str | None = Field(
        default=None,
        description="A reward model: a one-label LlamaFor/Qwen2ForSequenceClassification directory of the "
        "actor's vocabulary (its other shapes its own). Its score at each sequence's last real token is "
        "PPO's reward; reward.function still scores validation and is logged as rule_score.",
    )

    @field_validator("function")
    @classmethod
    def _form(cls, spec: str) -> str:
        problem = registry.spec_problem(spec)  # the form and the file's path; nothing runs here
        if problem:
            raise ValueError(problem)
        return spec

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            _check_name(name, "reward.env")
            if "\0" in value:
                raise ValueError(f"reward.env.{name} holds a NUL character, which no environment can hold")
        return env

    @field_validator("pass_env")
    @classmethod
    def _pass_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            _check_name(name, "reward.pass_env")
        return names

    @model_validator(mode="after")
    def _loads(self) -> RewardConfig:
        # A user's file is imported now, in a worker process with this section's limits and deadline,
        # so that a bad one stops the load and nothing it does at import reaches the driver.
        problem = registry.load_problem(self.function, self.worker_settings())
        if problem:
            raise ValueError(f"reward.function: {problem}")
        return self

    @field_validator("model_path")
    @classmethod
    def _is_dir(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).is_dir():
            raise ValueError(f"{shown(path)} is not a directory; give a Hugging Face model directory")
        return None if path is None else os.path.abspath(path)

    @property
    def inputs(self) -> str:
        """What the function reads: ``text`` (decoded responses) or ``tokens`` (the count task)."""
        return registry.inputs_of(self.function)

    def worker_settings(self, log_path: str | None = None) -> WorkerSettings:
        """How a user's function's worker runs; ``log_path``: where it writes (None: a temp file)."""
        return WorkerSettings(
            timeout_s=self.timeout_s,
            load_timeout_s=self.load_timeout_s,
            max_memory=int(self.max_memory),
            max_cpu_s=self.max_cpu_s,
            env=tuple(self.env.items()),
            pass_env=self.pass_env,
            log_path=log_path,
        )

    def resolve(self, log_path: str | None = None) -> registry.RewardFn:
        """The reward function: a built-in in this process, a user's in a worker process of its own
        (``nereus_core.rewards.worker``) run by ``worker_settings(log_path)``."""
        return registry.resolve(self.function, self.worker_settings(log_path))


def _check_name(name: str, key: str) -> None:
    if not name or "=" in name or "\0" in name or not name.isprintable():
        raise ValueError(f"{key}: {shown(name)} is not an environment variable name; use e.g. MY_TOKEN")


def job_lengths_from_data(raw: Any) -> Any:
    """The whole config mapping ``raw`` with job.prompt_len and job.response_len following
    data.max_prompt_length and data.max_response_length (one owner: the data section); given beside
    a data section they must be equal (ValueError in one line)."""
    section = raw.get("data") if isinstance(raw, dict) else None
    job = raw.get("job") or {} if isinstance(section, dict) else None
    if not isinstance(job, dict):
        return raw
    job, fields = dict(job), DataConfig.model_fields
    for ours, theirs in (("prompt_len", "max_prompt_length"), ("response_len", "max_response_length")):
        value = section.get(theirs, fields[theirs].default)  # type: ignore[union-attr]
        if ours in job and job[ours] != value:
            raise ValueError(
                f"job.{ours}={job[ours]} differs from data.{theirs}={value}; with a data section "
                f"set only data.{theirs}"
            )
        job[ours] = value
    return {**raw, "job": job}


def sections_problem(
    data: DataConfig | None,
    validation: ValidationConfig | None,
    reward: RewardConfig | None,
    *,
    max_position_embeddings: int,
    tokenizer_dir: str | None = None,
) -> str | None:
    """What the three sections get wrong together (or with the model: its length limit, its
    tokenizer directory, which chat prompts need with a chat template), as one line; None if nothing."""
    wants_val = validation is not None and (validation.every or validation.before_train)
    if wants_val and (data is None or not data.val_files):
        return "validation is on but data.val_files is empty; give validation prompt files"
    if data is not None:
        if tokenizer_dir is None:
            return "data needs a tokenizer: set model.path (a model directory) or model.tokenizer"
        problem = chat_template_error(tokenizer_dir)  # reads files only; the job loads it
        if problem:
            return problem
        total = data.max_prompt_length + data.max_response_length
        if total > max_position_embeddings:
            return (
                f"data.max_prompt_length+data.max_response_length={total} exceeds "
                f"model.max_position_embeddings={max_position_embeddings}; shorten them or raise the limit"
            )
    if reward is None:
        if data is not None:
            return (
                "data needs a reward: set reward.function "
                "(gsm8k, gsm8k_flexible, math or path/to/file.py:function)"
            )
        return None
    kind = registry.inputs_of(reward.function)
    if data is not None and kind == "tokens":
        return (
            f"reward.function={reward.function} scores the demo's token ids, not text prompts; "
            "with data: use gsm8k, gsm8k_flexible, math or path/to/file.py:function"
        )
    if data is None and kind == "text":
        return f"reward.function={reward.function} scores text responses; give data.train_files to score"
    return None


__all__ = ["DataConfig", "RewardConfig", "ValidationConfig", "job_lengths_from_data", "sections_problem"]
