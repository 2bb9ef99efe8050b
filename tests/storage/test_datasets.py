"""storage/datasets.py: verl-format Parquet and JSONL read into Examples, column and row errors in
one line naming the file, the length policy's log line, and a writer that never replaces a file."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nereus_core.config.data import DataConfig
from storage.datasets import (
    DatasetError,
    load_data,
    load_split,
    read_examples,
    read_jsonl_records,
    write_parquet,
)


def rows(n: int, words: int = 3) -> list[dict[str, Any]]:
    return [
        {
            "data_source": "test/echo",
            "prompt": [{"role": "user", "content": " ".join([f"w{i}"] * (words + i % 4))}],
            "ability": "echo",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(n)
    ]


def words(messages: Sequence[Mapping[str, str]]) -> list[int]:
    return [0] * sum(len(m["content"].split()) for m in messages)


def write_jsonl(path: Path, items: Sequence[Mapping[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def test_parquet_and_jsonl_read_alike(tmp_path: Path) -> None:
    parquet = tmp_path / "a.parquet"
    write_parquet(rows(4), parquet)
    jsonl = write_jsonl(tmp_path / "b.jsonl", rows(3))
    examples = read_examples([parquet, jsonl])
    assert [ex.index for ex in examples] == list(range(7))  # indexed across the files, in order
    assert [ex.ground_truth for ex in examples] == ["0", "1", "2", "3", "0", "1", "2"]
    assert examples[5].chat() == [{"role": "user", "content": "w1 w1 w1 w1"}]
    assert examples[5].extra_info == {"index": 1, "split": "train"}


def test_parquet_missing_columns_named_from_the_schema(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["q"], "prompt": [[{"role": "user", "content": "q"}]]}), path)
    with pytest.raises(DatasetError) as err:
        read_examples([path])
    assert str(err.value) == (
        f"{path}: missing columns data_source, reward_model; verl's format has columns data_source, "
        "prompt (a list of {role, content} messages), reward_model ({style, ground_truth}) and extra_info"
    )


def test_jsonl_missing_column_and_bad_row(tmp_path: Path) -> None:
    no_source = [{k: v for k, v in r.items() if k != "data_source"} for r in rows(2)]
    with pytest.raises(DatasetError, match=r"^.*no_source\.jsonl: missing column data_source;"):
        read_examples([write_jsonl(tmp_path / "no_source.jsonl", no_source)])
    bad = rows(3)
    bad[2]["prompt"] = [{"role": "robot", "content": "hi"}]
    with pytest.raises(
        DatasetError,
        match=r"bad\.jsonl: row 2: prompt\[0\]\.role='robot'; use one of system, user, assistant",
    ):
        read_examples([write_jsonl(tmp_path / "bad.jsonl", bad)])


def test_unreadable_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"junk\.parquet: not readable as Parquet: "):
        read_examples([junk])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"data_source": "x",\n')
    with pytest.raises(DatasetError, match=r"broken\.jsonl: not readable as JSONL"):
        read_examples([broken])
    mixed = rows(3)
    mixed[2]["prompt"] = [{"role": "user", "content": 5}]  # pyarrow names the line and the column
    with pytest.raises(DatasetError, match=r"mixed\.jsonl: not readable as JSONL .*content.* in row 2$"):
        read_examples([write_jsonl(tmp_path / "mixed.jsonl", mixed)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(
        DatasetError, match=r"empty\.jsonl: missing columns data_source, prompt, reward_model"
    ):
        read_examples([empty])
    with pytest.raises(DatasetError, match=r"gone\.parquet: no such file"):
        read_examples([tmp_path / "gone.parquet"])
    with pytest.raises(DatasetError, match=r"rows\.csv: not a \.parquet or \.jsonl file"):
        read_examples([tmp_path / "rows.csv"])


def test_load_split_filters_and_says_so_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    write_parquet(rows(8), path)  # prompt lengths 3, 4, 5, 6, 3, 4, 5, 6 words
    lines: list[str] = []
    split = load_split(
        [path], split="train", tokenize=words, max_prompt_length=4, truncation="filter", log=lines.append
    )
    assert [ex.index for ex in split.examples] == [0, 1, 4, 5]
    assert split.report.filtered == 4
    assert lines == [
        "data: train: filtered 4 of 8 prompts longer than data.max_prompt_length=4 tokens (longest 6); 4 kept"
    ]
    with pytest.raises(DatasetError, match=r"^data: train: row 2 has 5 prompt tokens"):
        load_split(
            [path], split="train", tokenize=words, max_prompt_length=4, truncation="error", log=lines.append
        )
    assert len(lines) == 1  # nothing logged for a refused split


def test_load_data_reads_both_splits_of_a_config(tmp_path: Path) -> None:
    train, val = tmp_path / "train.parquet", write_jsonl(tmp_path / "val.jsonl", rows(3, words=1))
    write_parquet(rows(8), train)
    data = DataConfig(train_files=(str(train),), val_files=(str(val),), max_prompt_length=5)
    lines: list[str] = []
    splits = load_data(data, tokenize=words, log=lines.append)
    assert {name: len(split.examples) for name, split in splits.items()} == {"train": 6, "val": 3}
    assert [line.split(":")[1] for line in lines] == [" train", " val"]
    only_train = DataConfig(train_files=(str(train),), max_prompt_length=5)
    assert list(load_data(only_train, tokenize=words, log=lines.append)) == ["train"]


def test_writer_never_replaces_a_file(tmp_path: Path) -> None:
    path = tmp_path / "out" / "train.parquet"
    assert write_parquet(rows(2), path) > 0
    before = path.read_bytes()
    with pytest.raises(DatasetError, match=r"exists already"):
        write_parquet(rows(5), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["train.parquet"]  # no temporary left


def test_read_jsonl_records(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "r.jsonl", [{"question": "q1", "answer": "#### 1"}, {"question": "q2"}])
    assert read_jsonl_records(path) == [
        {"question": "q1", "answer": "#### 1"},
        {"question": "q2", "answer": None},  # pyarrow unifies the keys of every line
    ]
    with pytest.raises(DatasetError, match=r"no such file"):
        read_jsonl_records(tmp_path / "none.jsonl")
