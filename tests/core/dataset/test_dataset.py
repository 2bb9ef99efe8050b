"""nereus_core.dataset: verl-format rows, the max-prompt-length policy, the seeded sampler (same seed
same order; resuming at a step gives the uninterrupted run's batch) and the GSM8K/MATH500 conversion."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_core.dataset import Sampler, apply_max_prompt_length, column_problem, parse_rows
from nereus_core.dataset.convert import (
    GSM8K_INSTRUCTION,
    MATH_INSTRUCTION,
    convert,
    gsm8k_row,
    math500_row,
    split_of,
)
from nereus_core.dataset.rows import Example, parse_row
from nereus_core.rewards import gsm8k


def row(content: str = "What is 1+1?", truth: Any = "2", **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "data_source": "test/add",
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"index": 0},
    }
    out.update(extra)
    return out


def words(messages: Sequence[Mapping[str, str]]) -> list[int]:
    """A stand-in tokenizer: one token per whitespace-separated word of every message."""
    return [0] * sum(len(m["content"].split()) for m in messages)


def test_column_problem_names_every_missing_column() -> None:
    assert column_problem(["data_source", "prompt", "reward_model", "extra_info"]) is None
    assert column_problem(["data_source", "prompt", "reward_model"]) is None  # extra_info optional
    problem = column_problem(["prompt", "question"])
    assert problem is not None and problem.startswith("missing columns data_source, reward_model;")
    assert "verl's format" in problem and "\n" not in problem


def test_parse_row_keeps_what_the_reward_needs() -> None:
    ex = parse_row(row(ability="math"), 7)
    assert ex == Example(
        7, "test/add", ({"role": "user", "content": "What is 1+1?"},), "2", "rule", {"index": 0}
    )
    assert ex.chat() == [{"role": "user", "content": "What is 1+1?"}]
    assert parse_row({k: v for k, v in row().items() if k != "extra_info"}, 0).extra_info == {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt": "What is 1+1?"}, "prompt must be a non-empty list"),
        ({"prompt": []}, "prompt must be a non-empty list"),
        ({"prompt": [{"role": "robot", "content": "x"}]}, "prompt\\[0\\].role='robot'"),
        ({"prompt": [{"role": "user"}]}, "prompt\\[0\\].content must be text"),
        ({"reward_model": {"style": "rule"}}, "reward_model.ground_truth is missing"),
        ({"reward_model": "2"}, "reward_model must be a"),
        ({"data_source": ""}, "data_source must be a non-empty string"),
        ({"extra_info": [1]}, "extra_info must be a mapping"),
    ],
)
def test_bad_rows_are_named(change: dict[str, Any], message: str) -> None:
    rows = [row(), {**row(), **change}]
    with pytest.raises(ValueError, match=f"^train.parquet: row 1: {message}"):
        parse_rows(rows, where="train.parquet")


def examples(lengths: Sequence[int]) -> list[Example]:
    return parse_rows([row(" ".join(["w"] * n)) for n in lengths], where="mem")


def test_filter_drops_overlong_prompts_and_reports_them() -> None:
    kept, report = apply_max_prompt_length(
        examples([3, 9, 5, 12, 4]), tokenize=words, max_prompt_length=5, truncation="filter", split="train"
    )
    assert [ex.index for ex in kept] == [0, 2, 4]
    assert (report.total, report.filtered, report.kept, report.longest) == (5, 2, 3, 12)
    assert report.line() == (
        "data: train: filtered 2 of 5 prompts longer than data.max_prompt_length=5 tokens "
        "(longest 12); 3 kept"
    )


def test_error_policy_refuses_the_first_overlong_prompt() -> None:
    with pytest.raises(
        ValueError, match=r"^data: val: row 1 has 9 prompt tokens, over data.max_prompt_length=5 \(2 rows"
    ):
        apply_max_prompt_length(
            examples([3, 9, 5, 12]), tokenize=words, max_prompt_length=5, truncation="error", split="val"
        )
    kept, report = apply_max_prompt_length(
        examples([3, 5]), tokenize=words, max_prompt_length=5, truncation="error", split="val"
    )
    assert len(kept) == 2 and report.filtered == 0


def test_nothing_left_is_refused() -> None:
    with pytest.raises(ValueError, match=r"all 2 prompts are longer .* \(shortest 7\)"):
        apply_max_prompt_length(
            examples([7, 8]), tokenize=words, max_prompt_length=5, truncation="filter", split="t"
        )
    with pytest.raises(ValueError, match="the files hold no rows"):
        apply_max_prompt_length([], tokenize=words, max_prompt_length=5, truncation="filter", split="t")


def test_sampler_epochs_cover_every_row_once() -> None:
    sampler = Sampler(size=10, batch_size=3, seed=1)
    assert sampler.batches_per_epoch == 3  # the last row of each epoch is dropped (drop_last)
    epoch0 = [i for k in range(3) for i in sampler.batch(k)]
    epoch1 = [i for k in range(3, 6) for i in sampler.batch(k)]
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9
    assert epoch0 != epoch1  # a new order each epoch
    assert sampler.batch(0) != Sampler(size=10, batch_size=3, seed=2).batch(0)


def test_sampler_without_shuffle_is_file_order() -> None:
    val = Sampler(size=7, batch_size=3, shuffle=False, drop_last=False)
    assert [val.batch(k) for k in range(val.batches_per_epoch)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_sampler_refuses_too_few_rows() -> None:
    with pytest.raises(ValueError, match="the split has 2 prompts, fewer than one batch of 4"):
        Sampler(size=2, batch_size=4)
    with pytest.raises(ValueError, match="step -1"):
        Sampler(size=4, batch_size=2).batch(-1)


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 60),
    batch=st.integers(1, 16),
    seed=st.integers(0, 2**32),
    resume=st.integers(0, 40),
)
def test_same_seed_same_order_and_resume_at_step(size: int, batch: int, seed: int, resume: int) -> None:
    if batch > size:
        batch = size
    steps = resume + 8
    run = Sampler(size=size, batch_size=batch, seed=seed)
    uninterrupted = dict(zip(range(steps), (rows for _, rows in run.batches()), strict=False))
    again = Sampler(size=size, batch_size=batch, seed=seed)  # a new process, same config
    resumed = again.batches(start_step=resume)
    for step in range(resume, steps):
        at, rows = next(resumed)
        assert at == step
        assert rows == uninterrupted[step] == again.batch(step)
        assert len(rows) == batch and len(set(rows)) == batch and all(0 <= i < size for i in rows)


def test_split_rule_is_every_fifth() -> None:
    assert [split_of(i) for i in range(6)] == ["test", "train", "train", "train", "train", "test"]


def test_gsm8k_row_is_verls() -> None:
    out = gsm8k_row({"question": "How many?", "answer": "2+2=4\n#### 1,004"}, 3)
    assert out["prompt"] == [{"role": "user", "content": f"How many? {GSM8K_INSTRUCTION}"}]
    assert out["reward_model"] == {"style": "rule", "ground_truth": "1004"}
    assert out["data_source"] == "openai/gsm8k" and out["extra_info"]["split"] == "train"
    assert gsm8k.score(out["extra_info"]["answer"], out["reward_model"]["ground_truth"]) == 1.0
    assert parse_row(out, 3).ground_truth == "1004"
    with pytest.raises(ValueError, match="record 4: no '#### <number>'"):
        gsm8k_row({"question": "q", "answer": "no marker"}, 4)
    with pytest.raises(ValueError, match="record 2: field 'question' is missing"):
        gsm8k_row({"answer": "#### 1"}, 2)


def test_math500_row_is_verls() -> None:
    rec = {
        "problem": "Find $x$.",
        "answer": "\\frac{1}{2}",
        "subject": "Algebra",
        "level": 2,
        "unique_id": "u",
    }
    out = math500_row(rec, 0)
    assert out["prompt"][0]["content"] == f"Find $x$. {MATH_INSTRUCTION}"
    assert out["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    assert out["extra_info"] == {
        "split": "test",
        "index": 0,
        "subject": "Algebra",
        "level": 2,
        "unique_id": "u",
    }


def test_convert_splits_by_the_rule() -> None:
    records = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(11)]
    splits = convert("gsm8k", records)
    assert [r["extra_info"]["index"] for r in splits["test"]] == [0, 5, 10]
    assert len(splits["train"]) == 8
