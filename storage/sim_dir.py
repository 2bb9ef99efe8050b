"""The output directory of ``nereus simulate``: each finished run kept as it completes, and the sweep's
tables built from whatever is finished.

    DIR/sweep.json               what the runs are of: the config (its ``sweep`` section, where runs
                                 execute, left out) and a digest of each trace; a directory of
                                 another sweep is refused
    DIR/runs/KEY.parquet         one finished run's step records    (KEY: trace--strategy--seedN)
    DIR/runs/KEY.json            its trace, strategy, seed, summary and plans; written last, so a
                                 run counts as finished once this file is there
    DIR/summary.json, steps.parquet, plans.json, timing.json    the sweep's, from the finished runs

Every file is written atomically (temporary name, fsync, rename): a sweep stopped at any moment
leaves each run either finished or absent. The summary is built from the runs' stored summaries,
so a sweep finished in two sittings writes the same ``summary.json`` as one that ran straight through.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from nereus_core.config import ConfigError
from nereus_core.sim.job import SimResult
from storage.errors import RunDirError
from storage.manifest import atomic_write, replacing

__all__ = ["SimDir", "run_file_key"]

SWEEP = "sweep.json"


def run_file_key(trace: str, strategy: str, seed: int) -> str:
    """The file name (without suffix) of one run under ``runs/``."""
    return f"{trace}--{strategy}--seed{seed}"


def _json(data: Any) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


class SimDir:
    """One simulation output directory (the ``--out`` of ``nereus simulate``)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.runs = self.root / "runs"

    def check(self, identity: Mapping[str, Any]) -> None:
        """``ConfigError`` with one line if the directory holds the runs of another sweep."""
        path = self.root / SWEEP
        if not path.exists():
            if self.runs.exists() and any(self.runs.glob("*.json")):
                raise ConfigError(f"{self.root} holds simulation runs without {SWEEP}; choose another --out")
            return
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ConfigError(f"{path} cannot be read ({err}); choose another --out") from None
        if stored != json.loads(json.dumps(identity)):
            what = "another config" if stored.get("config") != identity.get("config") else "other traces"
            raise ConfigError(
                f"{self.root} holds the runs of a simulation with {what}; "
                "give the config it was run with, or choose another --out"
            )

    def claim(self, identity: Mapping[str, Any]) -> None:
        """Check the directory (``check``) and record ``identity`` in it."""
        self.check(identity)
        self.runs.mkdir(parents=True, exist_ok=True)
        atomic_write(self.root / SWEEP, _json(identity))

    def write_run(self, result: SimResult) -> Path:
        """Keep one finished run: its step records, then the document that marks it finished."""
        key = run_file_key(result.trace, result.strategy, result.seed)
        self.runs.mkdir(parents=True, exist_ok=True)
        with replacing(self.runs / f"{key}.parquet") as tmp:
            pq.write_table(pa.Table.from_pylist(result.records), tmp)
        doc = {
            "trace": result.trace,
            "strategy": result.strategy,
            "seed": result.seed,
            "summary": result.summary,
            "plans": result.plans,
        }
        path = self.runs / f"{key}.json"
        atomic_write(path, _json(doc))
        return path

    def finished(self) -> set[str]:
        """The keys (``run_file_key``) of the finished runs."""
        return {p.stem for p in self.runs.glob("*.json")} if self.runs.exists() else set()

    def read_run(self, key: str) -> SimResult:
        """One finished run, as ``run_job`` returned it; ``RunDirError`` naming a damaged file."""
        path = self.runs / f"{key}.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            records = pq.read_table(self.runs / f"{key}.parquet").to_pylist()
            plans, summary = doc["plans"], doc["summary"]
            return SimResult(doc["trace"], doc["strategy"], doc["seed"], records, plans, summary)
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as err:
            raise RunDirError(
                f"{path}: a finished run cannot be read ({err}); remove it to run it again"
            ) from None

    def write_tables(self, results: Iterable[SimResult], summary: dict, timing: dict) -> list[Path]:
        """summary.json, steps.parquet (the runs' records in the order given), plans.json, timing.json."""
        results = list(results)
        tables = [pa.Table.from_pylist(r.records) for r in results if r.records]
        steps = pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})
        with replacing(self.root / "steps.parquet") as tmp:
            pq.write_table(steps, tmp)
        plans = {pid: text for r in results for pid, text in r.plans.items()}
        atomic_write(self.root / "plans.json", _json(dict(sorted(plans.items()))))
        atomic_write(self.root / "timing.json", _json(timing))
        atomic_write(self.root / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
        return [self.root / n for n in ("summary.json", "steps.parquet", "plans.json", "timing.json")]
