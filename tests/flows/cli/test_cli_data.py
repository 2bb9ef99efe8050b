"""``nereus data gsm8k|math500 --out DIR`` on the files shipped in data/text: row counts, verl's
columns, ground truths that parse back, a config that loads them; and bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.cli.data import SOURCES, TEXT_DIR
from flows.cli.main import main
from nereus_core.config import parse_config
from nereus_core.dataset.convert import GSM8K_INSTRUCTION, MATH_INSTRUCTION
from nereus_core.rewards import gsm8k, math_answer
from storage.datasets import read_examples
from tests.support.hf_models import write_tokenizer

COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def records(name: str) -> list[dict[str, object]]:
    with (TEXT_DIR / SOURCES[name]).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def convert(name: str, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    assert main(["data", name, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"nereus: data {name}: 400 train + 100 test rows" in said
    return out / "train.parquet", out / "test.parquet"


def test_gsm8k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train, test = convert("gsm8k", tmp_path, capsys)
    assert pq.read_schema(train).names == COLUMNS
    assert (pq.read_metadata(train).num_rows, pq.read_metadata(test).num_rows) == (400, 100)
    source = records("gsm8k")
    examples = read_examples([train, test])
    assert sorted(ex.extra_info["index"] for ex in examples) == list(range(500))
    for ex in examples:
        record = source[ex.extra_info["index"]]
        assert ex.extra_info["split"] == ("test" if ex.extra_info["index"] % 5 == 0 else "train")
        assert ex.messages == ({"role": "user", "content": f"{record['question']} {GSM8K_INSTRUCTION}"},)
        float(ex.ground_truth)  # a plain number
        assert "," not in ex.ground_truth
        # the reference solution scores 1.0 against the ground truth drawn from it
        assert gsm8k.score(str(record["answer"]), ex.ground_truth) == 1.0
        assert gsm8k.score(str(record["answer"]), ex.ground_truth + "1") == 0.0


def test_math500(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train, test = convert("math500", tmp_path, capsys)
    assert pq.read_schema(test).names == COLUMNS
    source = records("math500")
    examples = read_examples([train, test])
    assert len(examples) == 500
    for ex in examples:
        record = source[ex.extra_info["index"]]
        assert ex.ground_truth == record["answer"]
        assert ex.messages[0]["content"] == f"{record['problem']} {MATH_INSTRUCTION}"
        assert ex.extra_info["unique_id"] == record["unique_id"]
        # every real answer survives being boxed by a model and extracted again
        assert math_answer.score(f"So the answer is $\\boxed{{{ex.ground_truth}}}$.", ex.ground_truth) == 1.0


def test_a_config_loads_the_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train, test = convert("gsm8k", tmp_path, capsys)
    write_tokenizer(tmp_path / "tokenizer")  # chat prompts need a tokenizer with a chat template
    cfg = parse_config(
        {
            "model": {"max_position_embeddings": 1024, "tokenizer": str(tmp_path / "tokenizer")},
            "data": {"train_files": [str(train)], "val_files": [str(test)]},
            "validation": {"every": 10},
            "reward": {"function": "gsm8k"},
        }
    )
    assert cfg.data is not None and cfg.data.val_files == (str(test),)


def test_existing_output_is_never_replaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "test.parquet").write_text("mine")
    assert main(["data", "gsm8k", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"nereus: error: {tmp_path / 'test.parquet'}: exists already; remove it or choose another --out\n"
    )
    assert not (tmp_path / "train.parquet").exists()
    assert (tmp_path / "test.parquet").read_text() == "mine"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (None, "no such file"),
        ('{"question": "q", "answer": "no marker"}\n', "record 0: no '#### <number>'"),
        ('{"question": "q", "answer": "#### 1"}\n', "1 records are too few to split; need 5"),
        ("not json\n", "not readable as JSONL"),
    ],
)
def test_bad_source_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str | None, message: str
) -> None:
    source = tmp_path / "src.jsonl"
    if body is not None:
        source.write_text(body)
    out = tmp_path / "out"
    assert main(["data", "gsm8k", "--out", str(out), "--source", str(source)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nereus: error: ") and message in err and err.count("\n") == 1
    assert not out.exists()


def test_out_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "f"
    out.write_text("x")
    assert main(["data", "math500", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"nereus: error: {out}: is a file; --out names a directory\n"


def test_a_failed_second_write_leaves_neither_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import storage.datasets

    real = storage.datasets.write_parquet

    def full_disk_on_test(rows: object, path: Path) -> int:
        if path.name == "test.parquet":
            raise OSError(28, "No space left on device")
        return real(rows, path)  # type: ignore[arg-type]

    monkeypatch.setattr(storage.datasets, "write_parquet", full_disk_on_test)
    assert main(["data", "gsm8k", "--out", str(tmp_path)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
