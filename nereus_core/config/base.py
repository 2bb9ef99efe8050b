"""The config's shared pieces: its error type, how a bad value is shown, the cluster and trainer
sections, and what a run name may be.

Boundary: leaf definitions ``nereus_core.config`` builds the whole config from (and re-exports);
nothing here knows the whole config.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import ByteSize, Field, field_validator, model_validator

from nereus_core.frozen import Frozen


class ConfigError(ValueError):
    """A configuration value is invalid; ``str(err)`` is the one line to show the user."""


SHOWN_CHARS = 60  # the most characters of a bad value an error line shows


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr``-like text of ``value``, at most ``limit`` characters, built piece by piece so that a
    huge (or, from YAML aliases, exponentially shared) value costs no more than ``limit`` to show."""
    parts: list[str] = []
    _render(value, parts, [limit + 1])
    text = "".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _render(value: Any, parts: list[str], budget: list[int]) -> None:
    """Append ``value``'s text to ``parts`` while ``budget[0]`` (characters still wanted) lasts."""
    if budget[0] <= 0:
        return
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        opening, closing = {dict: "{}", list: "[]", tuple: "()"}.get(type(value), "{}")
        _emit(opening, parts, budget)
        for i, item in enumerate(value):
            if budget[0] <= 0:
                return
            _emit(", " if i else "", parts, budget)
            if isinstance(value, dict):
                _render(item, parts, budget)
                _emit(": ", parts, budget)
                item = value[item]
            _render(item, parts, budget)
        _emit(closing, parts, budget)
    elif isinstance(value, (str, bytes)):
        _emit(repr(value[: budget[0]]), parts, budget)
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        _emit(f"<a number of {value.bit_length()} bits>", parts, budget)  # str() of a huge int is slow
    else:
        _emit(repr(value)[: budget[0]], parts, budget)  # scalars YAML builds: short reprs


def _emit(text: str, parts: list[str], budget: list[int]) -> None:
    parts.append(text[: max(budget[0], 0)])
    budget[0] -= len(text)


class ClusterConfig(Frozen):
    """The device pool: how many device slots and how much memory each has."""

    devices: int = Field(default=2, ge=1, le=4096, description="Device slots in the pool.")
    memory_per_device: ByteSize = Field(
        default=ByteSize(2 * 1024**3),
        gt=0,
        description="Memory capacity of one device slot, e.g. '2GiB' or bytes.",
    )
    scheduler_address: str | None = Field(
        default=None,
        description=(
            "An existing Dask scheduler (tls://host:port, or tcp:// on a trusted network); "
            "None starts a LocalCluster on loopback."
        ),
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="torch.distributed backend; auto picks nccl on CUDA, gloo otherwise."
    )
    tls_ca_file: str | None = Field(
        default=None, description="PEM CA certificate of a tls:// scheduler's cluster (Dask TLS)."
    )
    tls_cert_file: str | None = Field(
        default=None, description="PEM certificate this driver presents to a tls:// scheduler."
    )
    tls_key_file: str | None = Field(default=None, description="PEM private key of tls_cert_file.")
    max_devices: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Grow onto workers the scheduler reports beyond the slots in use, up to this many "
        "slots: they are started and warmed while the job runs, then the job switches (None: never).",
    )
    # Reaching a scheduler is one handshake whatever the job's size, so no scale: Dask's own
    # connect timeout (distributed.comm.timeouts.connect) is 30 s.
    connect_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Seconds to reach cluster.scheduler_address before the run fails naming it.",
    )
    # A device call's deadline is call_timeout_s + call_timeout_s_per_token * its tokens per device.
    # The floor covers calls whose work the pool cannot count (loading a model directory, a reshard,
    # a checkpoint's shards: gigabytes at disk or link speed, minutes at most). 10 ms per token is
    # ~20x what an 8B model costs on one H100 (train ~0.5 ms, decode ~0.3 ms per token and device)
    # and ~5x the demo's tiny models on one CPU worker, so a healthy call never reaches it.
    call_timeout_s: float = Field(
        default=900.0,
        ge=1,
        le=7 * 24 * 3600,
        description="Floor of every device call's deadline, in seconds: a worker that gives no answer "
        "by its deadline is named as hung and the step fails (then nereus resume).",
    )
    call_timeout_s_per_token: float = Field(
        default=0.01,
        ge=0,
        le=60,
        description="Seconds added to a device call's deadline per token it processes on one device "
        "(prompt plus generated tokens, or the tokens of a forward or train micro-batch).",
    )
    # A CPU worker holds Python, torch and DeepSpeed (~0.7 GiB measured after a warm-up) beside the
    # slot's state, which a staged checkpoint and a live move's kept source shards may double.
    worker_memory_overhead: ByteSize = Field(
        default=ByteSize(4 * 1024**3),
        ge=0,
        description="Host memory a CPU device worker of a started cluster may hold beyond twice "
        "memory_per_device; past that its nanny kills it and the step names it (0: no limit).",
    )

    @model_validator(mode="after")
    def _check_tls(self) -> ClusterConfig:
        files = {
            "tls_ca_file": self.tls_ca_file,
            "tls_cert_file": self.tls_cert_file,
            "tls_key_file": self.tls_key_file,
        }
        given = [name for name, path in files.items() if path is not None]
        tls = (self.scheduler_address or "").startswith("tls://")
        if given and not tls:
            raise ValueError(
                f"cluster.{given[0]} is set but cluster.scheduler_address={shown(self.scheduler_address)} "
                "is not tls://; TLS files apply to a tls://host:port scheduler"
            )
        missing = [name for name, path in files.items() if path is None]
        if tls and missing:
            raise ValueError(
                f"cluster.scheduler_address is tls:// but cluster.{missing[0]} is not set; "
                "give tls_ca_file, tls_cert_file and tls_key_file"
            )
        return self


TrackerName = Literal["console", "tensorboard", "mlflow", "wandb"]


class TrainerConfig(Frozen):
    """Where a run's per-step metrics go besides its own tables (verl's ``trainer`` section).

    ``console``: the step table in the run logger at INFO (at DEBUG without it); ``tensorboard``:
    event files in RUN/tensorboard; ``mlflow``: a local store in RUN/mlflow, no server; ``wandb``:
    W&B in offline mode under RUN/wandb. Their packages: the ``tracking`` and ``wandb`` extras."""

    logger: tuple[TrackerName, ...] = Field(
        default=("console",),
        description="Metric trackers, as verl's trainer.logger: console, tensorboard, mlflow, wandb.",
    )
    project_name: str = Field(
        default="nereus",
        min_length=1,
        max_length=100,
        description="MLflow experiment and W&B project the run is logged under.",
    )

    @field_validator("logger", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value  # trainer.logger=tensorboard, as verl takes

    @field_validator("logger")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"trainer.logger={list(value)} names a tracker twice; name each once")
        return value


class CriticConfig(Frozen):
    """Where the critic's weights come from."""

    path: str | None = Field(
        default=None,
        description=(
            "A one-label LlamaFor/Qwen2For SequenceClassification or TokenClassification directory of the "
            "model's shapes (backbone and score.weight). None with model.path: the actor's backbone and a "
            "fresh value head (verl's critic); None without: the fitted reward model (OpenRLHF's)."
        ),
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        return None if path is None else os.path.abspath(path)


NAME_MAX_CHARS = 100
# Word characters (any script), '.', '_' and '-': no path separator, drive colon or control character.
_NAME = re.compile(r"\w[\w.-]*")


def name_error(name: str) -> str | None:
    """Why ``name`` is not a valid run name, or None. A run name becomes a directory name under
    ``runs/``, so it is a name, never a path (``/etc/x`` and ``../../x`` escaped ``runs/``)."""
    if len(name) > NAME_MAX_CHARS or not _NAME.fullmatch(name) or ".." in name:
        return (
            f"a run name is 1-{NAME_MAX_CHARS} letters, digits, '.', '_' or '-', starting with a letter "
            "or digit, without '..' (it names a directory under runs/, it is not a path)"
        )
    return None
