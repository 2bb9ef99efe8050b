"""``nereus data gsm8k|math500 --out DIR``: the project's GSM8K or MATH500 text made into
``DIR/train.parquet`` and ``DIR/test.parquet`` in verl's format (as verl's
``examples/data_preprocess/gsm8k.py`` and ``math_dataset.py`` do from Hugging Face).

    data/text/*.jsonl --storage.datasets--> records --nereus_core.dataset.convert--> rows --> Parquet

Only test splits ship (data/text/README.md), so the records are split by ``convert.split_of``.
Bad input ends in one line on stderr and exit status 2, before anything is written; existing
output files are never replaced.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TEXT_DIR = Path(__file__).resolve().parents[1] / "data" / "text"
SOURCES = {"gsm8k": "gsm8k_test_first500.jsonl", "math500": "math500_test.jsonl"}
EXIT_OK, EXIT_USAGE = 0, 2


def cmd_data(args: argparse.Namespace) -> int:
    """Convert the chosen data set's JSONL into train/test Parquet under ``--out``."""
    from nereus_core.dataset.convert import TEST_EVERY, convert
    from storage.datasets import DatasetError, existing, read_jsonl_records, write_parquet

    source = args.source or TEXT_DIR / SOURCES[args.dataset]
    out = Path(args.out)
    targets = [out / "train.parquet", out / "test.parquet"]
    if out.exists() and not out.is_dir():
        return _fail(out, "is a file; --out names a directory")
    already = existing(targets)
    if already:
        return _fail(already[0], "exists already; remove it or choose another --out")
    try:
        splits = convert(args.dataset, read_jsonl_records(source))
    except DatasetError as err:
        return _fail(None, str(err))
    except ValueError as err:  # a record without the fields the data set has
        return _fail(source, str(err))
    if not splits["train"] or not splits["test"]:
        return _fail(
            source, f"{sum(map(len, splits.values()))} records are too few to split; need {TEST_EVERY}"
        )
    try:
        for target, split in zip(targets, ("train", "test"), strict=True):
            write_parquet(splits[split], target)
    except (DatasetError, OSError) as err:
        return _fail(out, str(err))
    print(
        f"nereus: data {args.dataset}: {len(splits['train'])} train + {len(splits['test'])} test rows "
        f"(every {TEST_EVERY}th record from 0 to test) -> {targets[0]}, {targets[1]}"
    )
    return EXIT_OK


def _fail(where: Path | None, message: str) -> int:
    print(
        f"nereus: error: {message}" if where is None else f"nereus: error: {where}: {message}",
        file=sys.stderr,
    )
    return EXIT_USAGE


def add_data_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``nereus data`` with the CLI's subparsers."""
    data = sub.add_parser(
        "data",
        help="write GSM8K or MATH500 prompts as verl-format Parquet",
        description="Convert the project's GSM8K or MATH500 text (data/text) into DIR/train.parquet and "
        "DIR/test.parquet in verl's format; every 5th record (0, 5, 10, ...) goes to test.",
    )
    data.add_argument("dataset", choices=tuple(SOURCES), help="which data set")
    data.add_argument(
        "--out", required=True, type=Path, metavar="DIR", help="folder to write into (required)"
    )
    data.add_argument(
        "--source", type=Path, metavar="FILE", help="JSONL to read instead of the project's data/text file"
    )
    data.set_defaults(handler=cmd_data)
