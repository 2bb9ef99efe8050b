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
from collections.abc import Callable, Iterator, Mapping, Sequence
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
BATCH_ROWS = 4096  # rows converted to Python at a time
JSONL_BLOCK_BYTES = 64 << 20  # JSONL read this much at a time: the longest row it takes


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


def _opened(where: Path) -> tuple[list[str], int | None, Iterator[pa.RecordBatch]]:
    """The column names, the row count if the file's metadata tells it (Parquet), and its record
    batches, read one at a time."""
    if where.suffix == ".parquet":
        parquet = pq.ParquetFile(where)  # the footer only
        batches = parquet.iter_batches(batch_size=BATCH_ROWS)
        return parquet.schema_arrow.names, parquet.metadata.num_rows, batches
    if where.stat().st_size == 0:
        return [], 0, iter(())
    # Streaming, one block of the file at a time; a row must fit in one block.
    reader = pa_json.open_json(where, read_options=pa_json.ReadOptions(block_size=JSONL_BLOCK_BYTES))
    return reader.schema.names, None, iter(reader)


def read_examples(paths: Sequence[str | os.PathLike[str]], *, max_rows: int | None = None) -> list[Example]:
    """Every row of ``paths``, in order, as ``Example``s indexed across the files. Each file is read
    in batches of ``BATCH_ROWS`` rows, so it is never whole in memory beside its ``Example``s; past
    ``max_rows`` rows in all, DatasetError (a Parquet file is refused from its metadata, before any
    row is read). DatasetError (one line naming the file) for a file that is neither Parquet nor
    JSONL, a missing column, a bad row."""
    out: list[Example] = []
    for path in paths:
        where = Path(path)
        if where.suffix not in (".parquet", ".jsonl"):
            raise DatasetError(f"{where}: not a .parquet or .jsonl file")
        if not where.is_file():
            raise DatasetError(f"{where}: no such file")
        try:
            columns, rows, batches = _opened(where)
            problem = column_problem(columns)  # before any row is read
            if problem:
                raise DatasetError(f"{where}: {problem}")
            if max_rows is not None and rows is not None and len(out) + rows > max_rows:
                raise DatasetError(_too_many(where, len(out) + rows, max_rows))
            start = len(out)
            for batch in batches:
                if max_rows is not None and len(out) + batch.num_rows > max_rows:
                    raise DatasetError(_too_many(where, len(out) + batch.num_rows, max_rows))
                out.extend(
                    parse_rows(batch.to_pylist(), where=str(path), start=len(out), offset=len(out) - start)
                )
        except DatasetError:
            raise
        except ValueError as err:  # a bad row, named by parse_rows
            if not isinstance(err, pa.ArrowException):
                raise DatasetError(str(err)) from None
            raise DatasetError(_unreadable(where, err)) from None
        except (pa.ArrowException, OSError) as err:
            raise DatasetError(_unreadable(where, err)) from None
    return out


def _unreadable(where: Path, err: BaseException) -> str:
    kind = "Parquet" if where.suffix == ".parquet" else "JSONL (one JSON object per line)"
    if "straddl" in str(err):
        return f"{where}: a row is over {JSONL_BLOCK_BYTES >> 20} MiB; a prompt data set's rows are small"
    return f"{where}: not readable as {kind}: {_first_line(err)}"


def _too_many(where: Path, rows: int, max_rows: int) -> str:
    return (
        f"{where}: the split has {rows:,}+ rows, over data.max_rows={max_rows:,} (every prompt is "
        "rendered and held at the start); raise data.max_rows or split the data set"
    )


def load_split(
    paths: Sequence[str | os.PathLike[str]],
    *,
    split: str,
    tokenize: PromptTokenizer,
    max_prompt_length: int,
    truncation: Truncation,
    max_rows: int | None = None,
    chars_per_token: int | None = None,
    log: Callable[[str], None] = _LOG.info,
) -> LoadedSplit:
    """Read one split and apply ``data.max_prompt_length``; the filter count goes to ``log`` as one
    line. DatasetError (one line) for a bad file or row, or a split the policy refuses."""
    examples = read_examples(paths, max_rows=max_rows)
    try:
        kept, report = apply_max_prompt_length(
            examples,
            tokenize=tokenize,
            max_prompt_length=max_prompt_length,
            truncation=truncation,
            split=split,
            chars_per_token=chars_per_token,
        )
    except ValueError as err:
        raise DatasetError(str(err)) from None
    log(report.line())
    return LoadedSplit(kept, report)


def load_data(
    data: DataConfig,
    *,
    tokenize: PromptTokenizer,
    chars_per_token: int | None = None,
    log: Callable[[str], None] = _LOG.info,
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
            max_rows=data.max_rows,
            chars_per_token=chars_per_token,
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
    "write_parquet",
]
