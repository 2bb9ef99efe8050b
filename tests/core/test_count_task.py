"""The count task (nereus_core/count_task.py): scores by hand, prompts, baselines, synthetic data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from nereus_core.count_task import (
    TaskSettings,
    check_vocab,
    describe,
    digit_token,
    make_prompts,
    position_scores,
    random_policy_score,
    render,
    rule_score,
    summarize_scores,
    synthetic_responses,
)

NON = [0, 11, 20, 31]  # token ids that are not digits


def d(*digits: int) -> list[int]:
    """Token ids of digits."""
    return [x + 1 for x in digits]


def score(prompt: list[int], response: list[int], **kw: float) -> float:
    return float(rule_score(torch.tensor([prompt]), torch.tensor([response]), **kw)[0])


def test_perfect_count_wraps_and_scores_one() -> None:
    assert score(d(3, 1, 7), d(8, 9, 0, 1, 2)) == 1.0


def test_non_digits_score_zero() -> None:
    assert score(d(3, 1, 7), NON) == 0.0


def test_a_slip_in_the_middle_recovers_credit() -> None:
    # After 2: 3 (1), 4 (1), 9 (slip: 0.25), 0 (1, counts on from 9), 1 (1).
    assert score(d(2), d(3, 4, 9, 0, 1)) == pytest.approx(4.25 / 5)
    assert score(d(2), d(3, 4, 9, 0, 1), digit_credit=0.0) == pytest.approx(4 / 5)


def test_a_wrong_start_then_counting_loses_one_position() -> None:
    # After 5 the first token should be 6; 0 is another digit (0.25), then 1 2 3 count on.
    assert score(d(5), d(0, 1, 2, 3)) == pytest.approx(3.25 / 4)


def test_after_a_non_digit_the_latest_digit_is_the_reference() -> None:
    # After 2: 3 (1), non-digit (0), 4 (1: follows the 3), 5 (1).
    prompts, responses = torch.tensor([d(2)]), torch.tensor([[*d(3), 20, *d(4, 5)]])
    assert position_scores(prompts, responses).tolist() == [[1.0, 0.0, 1.0, 1.0]]


def test_rule_score_is_vectorised_over_rows() -> None:
    prompts = torch.tensor([d(9, 2), d(0, 5), d(1, 1)])
    responses = torch.tensor([d(3, 4, 5, 6), d(0, 1, 2, 3), [0, 11, *d(7, 8)]])
    # Row 2: non, non, 7 (0.25: the reference is the prompt's 1), 8 (1).
    expected = [1.0, 3.25 / 4, 1.25 / 4]
    assert rule_score(prompts, responses).tolist() == pytest.approx(expected)
    assert rule_score(prompts, responses).dtype == torch.float32


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=6),
    st.lists(st.integers(0, 63), min_size=1, max_size=8),
)
def test_scores_are_in_range_and_counting_is_perfect(prompt: list[int], response: list[int]) -> None:
    prompts = torch.tensor([d(*prompt)])
    assert 0.0 <= score(d(*prompt), response) <= 1.0
    count = [(prompt[-1] + i + 1) % 10 for i in range(len(response))]
    assert float(rule_score(prompts, torch.tensor([d(*count)]))[0]) == 1.0


def test_make_prompts_are_digits_and_deterministic() -> None:
    s = TaskSettings(prompt_len=6)
    a = make_prompts(s, batch=16, seed=3, step=7)
    assert a.shape == (16, 6) and a.dtype == torch.long
    assert bool(((a >= 1) & (a <= 10)).all())
    assert torch.equal(a, make_prompts(s, batch=16, seed=3, step=7))
    assert not torch.equal(a, make_prompts(s, batch=16, seed=3, step=8))
    assert not torch.equal(a, make_prompts(s, batch=16, seed=4, step=7))


@pytest.mark.parametrize("vocab", [32, 256])
def test_random_policy_score_matches_monte_carlo(vocab: int) -> None:
    expected = random_policy_score(vocab)
    assert expected == pytest.approx((1 + 9 * 0.25) / vocab)
    gen = torch.Generator().manual_seed(vocab)
    prompts = make_prompts(TaskSettings(), batch=20_000, seed=0, step=0)
    responses = torch.randint(0, vocab, (20_000, 8), generator=gen)
    # Standard error of the mean is below 5e-4 for V=32; 3e-3 is about six of them.
    assert float(rule_score(prompts, responses).mean()) == pytest.approx(expected, abs=3e-3)


def test_random_digits_score_a_third() -> None:
    gen = torch.Generator().manual_seed(1)
    prompts = make_prompts(TaskSettings(), batch=20_000, seed=0, step=1)
    responses = digit_token(torch.randint(0, 10, (20_000, 8), generator=gen))
    assert float(rule_score(prompts, responses).mean()) == pytest.approx(0.325, abs=5e-3)


def test_synthetic_responses_span_the_scores() -> None:
    prompts = make_prompts(TaskSettings(), batch=512, seed=0, step=0)
    responses = synthetic_responses(prompts, 8, torch.Generator().manual_seed(0), vocab_size=32)
    assert responses.shape == (512, 8) and responses.dtype == torch.long
    assert bool(((responses >= 0) & (responses < 32)).all())
    scores = rule_score(prompts, responses)
    assert float(scores.min()) < 0.2 and float(scores.max()) == 1.0
    # Not just the two ends: a good share lies in between.
    assert float(((scores > 0.35) & (scores < 0.95)).float().mean()) > 0.2
    again = synthetic_responses(prompts, 8, torch.Generator().manual_seed(0), vocab_size=32)
    assert torch.equal(responses, again)


def test_vocab_must_hold_the_digits() -> None:
    check_vocab(11)
    with pytest.raises(ValueError, match="vocab_size >= 11"):
        check_vocab(10)
    with pytest.raises(ValueError, match="end in a digit"):
        synthetic_responses(torch.tensor([[1, 0]]), 4, torch.Generator(), 32)


def test_task_settings_validate() -> None:
    s = TaskSettings()
    assert (s.name, s.prompt_len, s.response_len, s.digit_credit) == ("count", 8, 8, 0.25)
    with pytest.raises(ValidationError):
        TaskSettings.model_validate({"name": "sort"})
    with pytest.raises(ValidationError):
        TaskSettings.model_validate({"prompt_length": 4})
    with pytest.raises(ValidationError):
        TaskSettings(digit_credit=1.5)


def test_log_lines() -> None:
    line = describe(TaskSettings(), vocab_size=32)
    assert "0.102" in line and "0.325" in line and "\n" not in line
    assert summarize_scores(torch.tensor([0.5, 1.0])) == "score 0.750 (min 0.500, max 1.000, perfect 1/2)"
    assert render(torch.tensor(d(3, 1, 4)), torch.tensor([*d(5, 6), 20, *d(8)])) == "3 1 4 | 5 6 _ 8"
