"""storage/datasets.py against broken data files (tests/support/hostile_inputs.py): each one line
naming the file and row; a million rows refused from the Parquet metadata; a 10 MB prompt dropped
by its characters without being tokenized."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from storage.datasets import DatasetError, load_split
from tests.support.hostile_inputs import data_cases


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    return data_cases(tmp_path_factory.mktemp("data"))


def _words(messages: Sequence[Mapping[str, str]]) -> list[int]:
    text = " ".join(m["content"] for m in messages)
    assert len(text) < 100_000, "a prompt past the character bound is never tokenized"
    return [0] * (len(text.split()) + 2)


@pytest.mark.parametrize(
    "name",
    [
        "missing-column",
        "mistyped-column",
        "prompt-not-messages",
        "prompt-10mb",
        "empty-split",
        "million-rows",
        "not-parquet",
    ],
)
def test_each_bad_file_is_one_line(cases: dict[str, tuple[Path, str]], name: str) -> None:
    path, needle = cases[name]
    with pytest.raises(DatasetError) as err:
        load_split(
            [path],
            split="train",
            tokenize=_words,
            max_prompt_length=64,
            truncation="filter",
            max_rows=500_000,
            chars_per_token=16,
        )
    message = str(err.value)
    assert needle in message and "\n" not in message, message
    if name not in ("empty-split", "prompt-10mb"):  # a split's policy names the split, not a file
        assert str(path) in message


def test_a_file_is_read_in_batches_and_max_rows_counts_over_the_files(tmp_path: Path) -> None:
    from tests.support.hostile_inputs import ROW, write_jsonl

    rows = [dict(ROW, extra_info={"index": i}) for i in range(5000)]
    one, two = write_jsonl(tmp_path / "a.jsonl", rows), write_jsonl(tmp_path / "b.jsonl", rows[:10])
    kwargs = {"split": "train", "tokenize": _words, "max_prompt_length": 64, "truncation": "error"}
    loaded = load_split([one, two], max_rows=5010, **kwargs)  # type: ignore[arg-type]
    assert [e.index for e in loaded.examples] == list(range(5010))
    with pytest.raises(DatasetError, match=r"over data\.max_rows=5,009"):
        load_split([one, two], max_rows=5009, **kwargs)  # type: ignore[arg-type]
    bad = write_jsonl(tmp_path / "c.jsonl", [*rows, dict(ROW, data_source="")])
    with pytest.raises(DatasetError, match=r"c\.jsonl: row 5000: data_source"):
        load_split([bad], **kwargs)  # type: ignore[arg-type]
