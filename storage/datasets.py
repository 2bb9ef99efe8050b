"""Prompt data sets on disk: verl-format Parquet or JSONL read into ``Example``s, and rows written
as Parquet (``nereus data``).

    files --pyarrow--> rows --nereus_core.dataset.rows--> Examples --prompt_length--> kept + one log line

Each problem is a ``DatasetError`` with one line naming the file (and the row or column): a file
that is not Parquet or JSONL, missing required columns (all named, checked from the Parquet schema
before any row is read), a malformed row. Writing refuses to replace an existing file, and writes
through a temporary file so that a failed write leaves nothing half-written.

Boundary: pyarrow and files here; the rules (columns, rows, the length policy) are nereus_core's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from nereus_core.config.data import DataConfig
from nereus_core.dataset.prompt_length import (
    LengthReport,
    PromptTokenizer,
    Truncation,
    apply_max_prompt_length,
)
from nereus_core.dataset.rows import Example, column_problem, parse_rows

_LOG = logging.getLogger("nereus.data")


class DatasetError(ValueError):
    """A data file cannot be used as it is; ``str(err)`` is one line naming the file."""


@dataclass(frozen=True)
class LoadedSplit:
    """One split's prompts after the length policy, and what the policy did."""

    examples: list[Example]
    report: LengthReport


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def read_table(path: str | os.PathLike[str]) -> pa.Table:
    """The table in a ``.parquet`` or ``.jsonl`` file; DatasetError (one line) if it is neither,
    cannot be read, or (Parquet) lacks a required column."""
    where = Path(path)
    if where.suffix not in (".parquet", ".jsonl"):
        raise DatasetError(f"{where}: not a .parquet or .jsonl file")
    if not where.is_file():
        raise DatasetError(f"{where}: no such file")
    try:
        if where.suffix == ".parquet":
            problem = column_problem(pq.read_schema(where).names)  # before reading any row
            if problem:
                raise DatasetError(f"{where}: {problem}")
            return pq.read_table(where)
        if where.stat().st_size == 0:
            return pa.table({})
        return pa_json.read_json(where)
    except DatasetError:
        raise
    except (pa.ArrowException, OSError) as err:
        kind = "Parquet" if where.suffix == ".parquet" else "JSONL (one JSON object per line)"
        raise DatasetError(f"{where}: not readable as {kind}: {_first_line(err)}") from None


def read_examples(paths: Sequence[str | os.PathLike[str]]) -> list[Example]:
    """Every row of ``paths``, in order, as ``Example``s indexed across the files."""
    out: list[Example] = []
    for path in paths:
        table = read_table(path)
        problem = column_problem(table.column_names)
        if problem:
            raise DatasetError(f"{path}: {problem}")
        try:
            out.extend(parse_rows(table.to_pylist(), where=str(path), start=len(out)))
        except ValueError as err:
            raise DatasetError(str(err)) from None
    return out


def load_split(
    paths: Sequence[str | os.PathLike[str]],
    *,
    split: str,
    tokenize: PromptTokenizer,
    max_prompt_length: int,
    truncation: Truncation,
    log: Callable[[str], None] = _LOG.info,
) -> LoadedSplit:
    """Read one split and apply ``data.max_prompt_length``; the filter count goes to ``log`` as one
    line. DatasetError (one line) for a bad file or row, or a split the policy refuses."""
    examples = read_examples(paths)
    try:
        kept, report = apply_max_prompt_length(
            examples,
            tokenize=tokenize,
            max_prompt_length=max_prompt_length,
            truncation=truncation,
            split=split,
        )
    except ValueError as err:
        raise DatasetError(str(err)) from None
    log(report.line())
    return LoadedSplit(kept, report)


def load_data(
    data: DataConfig, *, tokenize: PromptTokenizer, log: Callable[[str], None] = _LOG.info
) -> dict[str, LoadedSplit]:
    """The ``train`` split of a ``data`` config section, and ``val`` when it names files."""
    files = {"train": data.train_files, "val": data.val_files}
    return {
        split: load_split(
            paths,
            split=split,
            tokenize=tokenize,
            max_prompt_length=data.max_prompt_length,
            truncation=data.truncation,
            log=log,
        )
        for split, paths in files.items()
        if paths
    }


def read_jsonl_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The objects of a JSONL file (one per line), as dicts."""
    where = Path(path)
    if not where.is_file():
        raise DatasetError(f"{where}: no such file")
    try:
        return pa_json.read_json(where).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(f"{where}: not readable as JSONL: {_first_line(err)}") from None


def existing(paths: Sequence[Path]) -> list[Path]:
    """Those of ``paths`` that exist already (a writer refuses to replace them)."""
    return [path for path in paths if path.exists()]


def write_parquet(rows: Sequence[Mapping[str, Any]], path: Path) -> int:
    """Write ``rows`` to a new Parquet file at ``path``; the bytes written. Refuses an existing file."""
    if path.exists():
        raise DatasetError(f"{path}: exists already; remove it or choose another --out")
    table = pa.Table.from_pylist([dict(row) for row in rows])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


__all__ = [
    "DatasetError",
    "LoadedSplit",
    "existing",
    "load_data",
    "load_split",
    "read_examples",
    "read_jsonl_records",
    "read_table",
    "write_parquet",
]
