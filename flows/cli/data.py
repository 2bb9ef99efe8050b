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
from collections.abc import Callable
from functools import partial
from pathlib import Path

TEXT_DIR = Path(__file__).resolve().parents[2] / "data" / "text"
SOURCES = {"gsm8k": "gsm8k_test_first500.jsonl", "math500": "math500_test.jsonl"}
EXIT_OK = 0
Fail = Callable[
    [Path | None, str], int
]  # flows/cli/main.py's one-line error: prints it, returns exit status 2


def cmd_data(args: argparse.Namespace, *, fail: Fail) -> int:
    """Convert the chosen data set's JSONL into train/test Parquet under ``--out``."""
    from nereus_core.dataset.convert import TEST_EVERY, convert
    from storage.datasets import DatasetError, existing, read_jsonl_records, write_parquet

    source = args.source or TEXT_DIR / SOURCES[args.dataset]
    out = Path(args.out)
    targets = [out / "train.parquet", out / "test.parquet"]
    if out.exists() and not out.is_dir():
        return fail(out, "is a file; --out names a directory")
    already = existing(targets)
    if already:
        return fail(already[0], "exists already; remove it or choose another --out")
    try:
        splits = convert(args.dataset, read_jsonl_records(source))
    except DatasetError as err:
        return fail(None, str(err))
    except ValueError as err:  # a record without the fields the data set has
        return fail(source, str(err))
    if not splits["train"] or not splits["test"]:
        return fail(
            source, f"{sum(map(len, splits.values()))} records are too few to split; need {TEST_EVERY}"
        )
    written: list[Path] = []
    try:
        for target, split in zip(targets, ("train", "test"), strict=True):
            write_parquet(splits[split], target)
            written.append(target)
    except (DatasetError, OSError) as err:
        for path in written:  # both files or neither: only what this command wrote is removed
            path.unlink(missing_ok=True)
        return fail(out, str(err))
    print(
        f"nereus: data {args.dataset}: {len(splits['train'])} train + {len(splits['test'])} test rows "
        f"(every {TEST_EVERY}th record from 0 to test) -> {targets[0]}, {targets[1]}"
    )
    return EXIT_OK


def add_data_command(sub: argparse._SubParsersAction, *, fail: Fail) -> None:  # type: ignore[type-arg]
    """Register ``nereus data`` with the CLI's subparsers; ``fail`` reports bad input."""
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
    data.set_defaults(handler=partial(cmd_data, fail=fail))
