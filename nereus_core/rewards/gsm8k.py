"""GSM8K's rule reward, as verl scores it (``verl/utils/reward_score/gsm8k.py``, after ReFT, Trung
et al., ACL 2024): 1.0 when the extracted answer equals the ground truth as a string, else 0.0.

Two ways to find the answer, both on the last 300 characters of the response only (verl clips
there: the answer comes last, and regexes over long responses are slow):

- strict (verl's default): the number after the last ``#### `` (the format the prompt asks for);
  commas are removed, so ``#### 1,234`` answers 1234. ``#### $5`` has no number right after the
  space and answers nothing, as in verl.
- flexible: the last run of digits, ``.``, ``,`` and a leading ``-`` anywhere, skipping a lone
  ``.``. Like verl it keeps what it found verbatim: "is 18." answers ``18.`` and "1,000" answers
  ``1,000``, neither of which equals a ground truth of 18 or 1000.

The ground truth is verl's too: the number after ``####`` in GSM8K's reference answer, commas removed
(``ground_truth``). Boundary: strings in, a float out; nothing here raises on any response text.
"""

from __future__ import annotations

import re
from typing import Any, Literal

CLIP_CHARS = 300  # verl's _SOLUTION_CLIP_CHARS
CORRECT, FORMAT_SCORE = 1.0, 0.0  # verl's score and format_score defaults

_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def extract(solution: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer ``solution`` gives by ``method``, or None when it gives none."""
    tail = solution[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "") if found else None  # "$" cannot follow "#### " here
    for number in reversed(_NUMBER.findall(tail)):
        if number not in ("", "."):
            return number
    return None


def score(solution: str, ground_truth: Any, method: Literal["strict", "flexible"] = "strict") -> float:
    """1.0 if ``solution``'s answer is ``ground_truth`` (compared as strings), else 0.0."""
    answer = extract(solution, method)
    if answer is None:
        return 0.0
    return CORRECT if answer == str(ground_truth) else FORMAT_SCORE


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The strict scorer with verl's reward-function signature."""
    return score(solution_str, ground_truth, "strict")


def compute_score_flexible(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    """The flexible scorer with verl's reward-function signature."""
    return score(solution_str, ground_truth, "flexible")


def ground_truth(reference_answer: str) -> str:
    """The number after ``#### `` in a GSM8K reference answer, commas removed (verl's preprocessing).

    Raises ValueError naming the text when there is none: a data set row without an answer."""
    found = _STRICT.search(reference_answer)
    if found is None:
        raise ValueError(f"no '#### <number>' in the reference answer {reference_answer[-80:]!r}")
    return found.group(1).replace(",", "")


__all__ = ["CLIP_CHARS", "compute_score", "compute_score_flexible", "extract", "ground_truth", "score"]
