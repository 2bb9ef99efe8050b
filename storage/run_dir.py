"""The run directory's tables and documents (layout: storage/FORMAT.md).

Everything here is written atomically (temporary name in the same directory,
fsync, rename), so a run killed at any moment leaves each file either at its
previous content or at its new one. Tables are Parquet; documents are JSON or
YAML. No pickle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

STEPS_TABLE = "metrics/steps.parquet"
TRANSITIONS_TABLE = "metrics/transitions.parquet"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _atomic_parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _column(values: Any) -> Any:
    """Tensors become (nested) lists so that Arrow infers list<...> columns."""
    if isinstance(values, torch.Tensor):
        return values.tolist()
    return values


class RunDir:
    """One run's directory: config, summary, metrics tables, rollouts and plans."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @classmethod
    def create(cls, root: str | os.PathLike[str], config: Mapping[str, Any]) -> RunDir:
        """Make the directory tree and write the resolved config."""
        run = cls(root)
        for sub in ("metrics", "rollouts", "plans", "state"):
            (run.root / sub).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(run.root / "config.yaml", yaml.safe_dump(dict(config), sort_keys=False).encode())
        return run

    def read_config(self) -> dict[str, Any]:
        return yaml.safe_load((self.root / "config.yaml").read_text())

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        atomic_write_bytes(self.root / "summary.json", json.dumps(dict(summary), indent=2).encode())

    def read_summary(self) -> dict[str, Any]:
        return json.loads((self.root / "summary.json").read_text())

    def write_plan(self, plan_id: str, plan: Mapping[str, Any]) -> None:
        atomic_write_bytes(self.root / "plans" / f"{plan_id}.json", json.dumps(dict(plan), indent=2).encode())

    def write_rows(self, table: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Replace ``table`` (e.g. ``STEPS_TABLE``) with ``rows``; all rows share one schema."""
        rows = [dict(r) for r in rows]
        _atomic_parquet(self.root / table, pa.Table.from_pylist(rows))

    def read_rows(self, table: str) -> list[dict[str, Any]]:
        path = self.root / table
        return pq.read_table(path).to_pylist() if path.exists() else []

    def write_rollout(self, step: int, columns: Mapping[str, Any]) -> Path:
        """``rollouts/step=N.parquet``: one row per sequence; tensors become list columns."""
        table = pa.table({name: _column(values) for name, values in columns.items()})
        path = self.root / "rollouts" / f"step={step}.parquet"
        _atomic_parquet(path, table)
        return path

    def read_rollout(self, step: int) -> dict[str, list[Any]]:
        return pq.read_table(self.root / "rollouts" / f"step={step}.parquet").to_pydict()

    def checkpoint_path(self, step: int) -> Path:
        return self.root / "state" / "checkpoints" / f"step={step}.json"

    def write_checkpoint(self, step: int, record: Mapping[str, Any]) -> None:
        """``state/checkpoints/step=N.json``: written after every model's snapshot at ``step`` committed,
        so it marks a complete resume point (the plan in force, the devices, the job's settings)."""
        path = self.checkpoint_path(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps({"step": step, **dict(record)}, indent=2).encode())

    def latest_checkpoint(self) -> dict[str, Any] | None:
        """The newest complete resume point, or None."""
        root = self.root / "state" / "checkpoints"
        found = []
        for path in root.glob("step=*.json") if root.is_dir() else []:
            record = json.loads(path.read_text())
            found.append((int(record["step"]), record))
        return max(found, key=lambda x: x[0])[1] if found else None
