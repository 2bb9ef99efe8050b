"""Reward functions: verl's GSM8K and MATH rule scorers, the demo's ``count``, and a user's own file.

``registry`` owns what ``reward.function`` may name and how one is called; ``gsm8k`` and
``math_answer`` are the built-in text scorers.
"""

from __future__ import annotations

from nereus_core.rewards.registry import (
    BUILTINS,
    RewardError,
    RewardFn,
    Scored,
    resolve,
    score_text,
    score_tokens,
    spec_problem,
)

__all__ = [
    "BUILTINS",
    "RewardError",
    "RewardFn",
    "Scored",
    "resolve",
    "score_text",
    "score_tokens",
    "spec_problem",
]
