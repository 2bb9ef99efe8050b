"""The run directory's tables and documents (layout: storage/FORMAT.md).

Everything here is written atomically (temporary name in the same directory,
fsync, rename), so a run killed at any moment leaves each file either at its
previous content or at its new one. Tables are Parquet; documents are JSON or
YAML. No pickle.

Everything read back is treated as input a user may have damaged or edited: a
truncated or invalid document, a record missing what a resume needs, a config that
is not a mapping is refused with ``RunDirError``, one line naming the file and what
is wrong. ``run.json`` holds the run's identity: a random ``run_id`` written when the
directory is created, and the ``incarnation`` of its driver (0 for the driver that
created it, +1 for each driver that resumed it); checkpoint records are stamped with
both, so a checkpoint is only ever read together with its own snapshots.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nereus_core.config import ConfigError
from nereus_core.config.from_yaml import parse_yaml
from nereus_core.layout import Layout
from storage.errors import RunDirError
from storage.manifest import atomic_write, replacing

STEPS_TABLE = "metrics/steps.parquet"
TRANSITIONS_TABLE = "metrics/transitions.parquet"
RUN_FILE = "run.json"
RUN_FORMAT = "nereus-run"
CONFIG_MAX_BYTES = 1 << 20  # a resolved config is a few KiB; more is not a config we wrote
_CHECKPOINT_RE = re.compile(r"^step=(\d+)\.json$")

__all__ = ["RunDir", "RunDirError", "RunIdentity", "atomic_write_bytes"]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        tmp.write_bytes(data)


def _atomic_parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        pq.write_table(table, tmp)


def _column(values: Any) -> Any:
    """Tensors become (nested) lists so that Arrow infers list<...> columns."""
    if isinstance(values, torch.Tensor):
        return values.tolist()
    return values


@dataclass(frozen=True)
class RunIdentity:
    """Who is writing a run directory: the run's id and the current driver's incarnation (run.json)."""

    run_id: str
    incarnation: int


class _RunFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: str = Field(pattern=f"^{RUN_FORMAT}$")
    version: int = Field(ge=1, le=1)
    run_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    created: str
    incarnation: int = Field(ge=0)


class CheckpointRecord(BaseModel):
    """What a resume needs from ``state/checkpoints/step=N.json``; other keys are the job's own."""

    model_config = ConfigDict(frozen=True, extra="allow")

    step: int = Field(ge=0)
    plan: dict[str, Layout]
    devices: int = Field(ge=1)
    response_len: int = Field(ge=1)
    run_id: str
    incarnation: int = Field(ge=0)


def _validation_line(path: Path, err: ValidationError) -> RunDirError:
    first = err.errors()[0]
    where = ".".join(str(x) for x in first["loc"])[:120]
    if first["type"] == "missing":
        return RunDirError(f"{path}: missing key {where!r}")
    return RunDirError(f"{path}: {where}: {first['msg'][:200]}")


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunDirError(f"{path}: missing; {path.parent} holds no {what}") from None
    except UnicodeDecodeError:
        raise RunDirError(f"{path}: not UTF-8 text; the file is damaged") from None


def _load_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``, or a one-line ``RunDirError`` (missing, truncated, not an object)."""
    text = _read_text(path, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise RunDirError(
            f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
            "the file is truncated or damaged"
        ) from None
    if not isinstance(data, dict):
        raise RunDirError(f"{path}: not a JSON object but {type(data).__name__}; the file is damaged")
    return data


def _load_yaml_mapping(path: Path) -> dict[str, Any]:
    size = path.stat().st_size if path.exists() else 0
    if size > CONFIG_MAX_BYTES:
        raise RunDirError(f"{path}: {size} bytes; a run's config is at most {CONFIG_MAX_BYTES} bytes")
    if not path.exists():
        raise RunDirError(f"{path.parent} is not a run directory (no {path.name})")
    text = _read_text(path, "run config")
    try:
        data = parse_yaml(text)  # safe types, bounded values (aliases expanded) and depth
    except ConfigError as err:
        raise RunDirError(f"{path}: {err}") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{path}: not a mapping but {type(data).__name__}; the file is damaged")
    return data


def _read_table(path: Path) -> pa.Table:
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        if isinstance(err, FileNotFoundError):
            raise RunDirError(f"{path}: missing") from None
        raise RunDirError(f"{path}: not a readable Parquet table; the file is damaged") from None


class RunDir:
    """One run's directory: identity, config, summary, metrics tables, rollouts, plans, checkpoints."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @classmethod
    def create(cls, root: str | os.PathLike[str], config: Mapping[str, Any]) -> RunDir:
        """Make the directory tree, write the resolved config and a new identity (incarnation 0).

        Every create starts a new run, even in a directory that held one: its old checkpoints
        and snapshots carry another run id and are never resumed or reused."""
        run = cls(root)
        for sub in ("metrics", "rollouts", "plans", "state"):
            (run.root / sub).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(run.root / "config.yaml", yaml.safe_dump(dict(config), sort_keys=False).encode())
        created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        run._write_identity(
            _RunFile(
                format=RUN_FORMAT, version=1, run_id=secrets.token_hex(16), created=created, incarnation=0
            )
        )
        return run

    def _write_identity(self, record: _RunFile) -> None:
        atomic_write(self.root / RUN_FILE, record.model_dump_json(indent=2).encode())

    def _read_identity(self) -> _RunFile:
        path = self.root / RUN_FILE
        data = _load_json(path, "run identity (a run directory of an older Nereus, or not one)")
        try:
            return _RunFile.model_validate(data)
        except ValidationError as err:
            raise _validation_line(path, err) from None

    def identity(self) -> RunIdentity:
        """The run id and the current driver's incarnation, from run.json."""
        record = self._read_identity()
        return RunIdentity(record.run_id, record.incarnation)

    def begin_incarnation(self) -> int:
        """A new driver takes over the run (``nereus resume``): increment the incarnation, durably, and
        return it. Call it holding the run's lock (storage.lock.run_lock)."""
        record = self._read_identity()
        new = record.model_copy(update={"incarnation": record.incarnation + 1})
        self._write_identity(new)
        return new.incarnation

    def read_config(self) -> dict[str, Any]:
        """config.yaml as a mapping; ``RunDirError`` if missing, not YAML, too big or not a mapping."""
        return _load_yaml_mapping(self.root / "config.yaml")

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        atomic_write_bytes(self.root / "summary.json", json.dumps(dict(summary), indent=2).encode())

    def read_summary(self) -> dict[str, Any]:
        """summary.json; ``RunDirError`` if missing (the run has not finished), truncated or damaged."""
        return _load_json(self.root / "summary.json", "summary (the run has not finished)")

    def write_plan(self, plan_id: str, plan: Mapping[str, Any]) -> None:
        atomic_write_bytes(self.root / "plans" / f"{plan_id}.json", json.dumps(dict(plan), indent=2).encode())

    def write_rows(self, table: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Replace ``table`` (e.g. ``STEPS_TABLE``) with ``rows``; its columns are every key any row
        has (a row without one holds null there: validation scores exist only on validated steps)."""
        rows = [dict(r) for r in rows]
        keys = dict.fromkeys(k for r in rows for k in r)
        _atomic_parquet(self.root / table, pa.table({k: [r.get(k) for r in rows] for k in keys}))

    def read_rows(self, table: str) -> list[dict[str, Any]]:
        path = self.root / table
        return _read_table(path).to_pylist() if path.exists() else []

    def write_rollout(self, step: int, columns: Mapping[str, Any]) -> Path:
        """``rollouts/step=N.parquet``: one row per sequence; tensors become list columns."""
        table = pa.table({name: _column(values) for name, values in columns.items()})
        path = self.root / "rollouts" / f"step={step}.parquet"
        _atomic_parquet(path, table)
        return path

    def read_rollout(self, step: int) -> dict[str, list[Any]]:
        return _read_table(self.root / "rollouts" / f"step={step}.parquet").to_pydict()

    def checkpoint_path(self, step: int) -> Path:
        return self.root / "state" / "checkpoints" / f"step={step}.json"

    def checkpoint_steps(self) -> list[int]:
        """Steps with a checkpoint record on disk (any run id, not validated), oldest first."""
        root = self.root / "state" / "checkpoints"
        names = (p.name for p in root.iterdir()) if root.is_dir() else iter(())
        return sorted(int(m.group(1)) for n in names if (m := _CHECKPOINT_RE.match(n)))

    def write_checkpoint(self, step: int, record: Mapping[str, Any]) -> None:
        """``state/checkpoints/step=N.json``: written after every model's snapshot at ``step`` committed,
        so it marks a complete resume point (the plan in force, the devices, the job's settings).
        Stamped with the run id and the current incarnation (run.json), which its snapshots carry."""
        me = self.identity()
        stamped = {"step": step, **dict(record), "run_id": me.run_id, "incarnation": me.incarnation}
        path = self.checkpoint_path(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(stamped, indent=2).encode())

    def read_checkpoint(self, step: int) -> dict[str, Any]:
        """The record at ``step``, checked: ``RunDirError`` if missing, truncated, of another step or
        lacking what a resume needs (``step``, ``plan``, ``devices``, ``response_len``, ``run_id``,
        ``incarnation``)."""
        path = self.checkpoint_path(step)
        data = _load_json(path, f"checkpoint at step {step}")
        try:
            record = CheckpointRecord.model_validate(data)
        except ValidationError as err:
            raise _validation_line(path, err) from None
        if record.step != step:
            raise RunDirError(f"{path}: holds step {record.step}, not {step}; the file was moved or edited")
        return data

    def latest_checkpoint(self) -> dict[str, Any] | None:
        """The newest complete resume point of this run (records of another run id are left out), or
        None. A damaged newest record is refused (``RunDirError``), not silently passed over: removing
        it resumes from the one before."""
        steps = self.checkpoint_steps()
        run_id = self.identity().run_id if steps else None
        for step in reversed(steps):
            record = self.read_checkpoint(step)
            if record["run_id"] == run_id:
                return record
        return None
