"""The reward of the TRL side-by-side benchmark (benchmarks/bench_trl.py): the share of a response's
characters that are digits. A dense signal that a random tiny model can move within a few steps
(a GSM8K answer's correctness would stay 0 for it).

``digit_share`` has verl's signature, as ``reward.function: examples/rewards/digit_share.py:digit_share``
calls it; ``trl_digit_share`` is the thin wrapper TRL's ``reward_funcs`` call (completions in, one
float per completion out), so both systems score with the same function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def digit_share(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None
) -> float:
    """Digits / characters of ``solution_str`` (0.0 for an empty response)."""
    return sum(c.isdigit() for c in solution_str) / len(solution_str) if solution_str else 0.0


def completion_text(completion: str | Sequence[Mapping[str, str]]) -> str:
    """A TRL completion's text: a plain string, or the content of a conversational completion's turn."""
    if isinstance(completion, str):
        return completion
    return "".join(str(turn["content"]) for turn in completion)


def trl_digit_share(
    completions: Sequence[Any],
    data_source: Sequence[str],
    reward_model: Sequence[Mapping[str, str]],
    extra_info: Sequence[Mapping[str, Any] | None] | None = None,
    **_: Any,
) -> list[float]:
    """TRL's side: each completion scored by ``digit_share`` with its row's verl columns (TRL hands
    the data set's other columns to a reward function by name, repeated for every generation)."""
    extras = extra_info if extra_info is not None else [None] * len(completions)
    return [
        digit_share(source, completion_text(c), str(rm["ground_truth"]), extra)
        for c, source, rm, extra in zip(completions, data_source, reward_model, extras, strict=True)
    ]
