"""MATH's rule reward, as verl scores it (``verl/utils/reward_score/math.py``, itself the Hendrycks
MATH normalisation of EleutherAI's lm-evaluation-harness): 1.0 when the response's last boxed
answer is the ground truth after both are normalised, else 0.0.

The answer is the content of the last ``\\boxed{...}`` (braces balanced, so ``\\boxed{\\frac{1}{2}}``
gives ``\\frac{1}{2}``), or of ``\\boxed x`` up to the next ``$``, or of the last ``\\fbox{...}`` when
there is no ``\\boxed``. An unclosed box gives no answer (score 0).

Normalisation (``normalize``), in verl's order: drop line breaks and ``\\!``; ``\\\\`` -> ``\\``;
``\\tfrac``/``\\dfrac`` -> ``\\frac``; drop ``\\left``, ``\\right``, degree marks (``^\\circ``),
``\\$``, units (everything from ``\\text{ `` on), ``\\%``; ``.5`` -> ``0.5``; drop a short
``k = `` prefix; ``\\sqrt3`` -> ``\\sqrt{3}``; drop spaces; ``\\frac12`` -> ``\\frac{1}{2}``;
``0.5`` -> ``\\frac{1}{2}``; ``3/4`` -> ``\\frac{3}{4}``; an integer loses its leading zeros. One rule
is added to verl's: trailing periods are dropped (``\\boxed{5.}`` is 5), as
verl's newer Qwen-math variant does. Equivalence is string equality of the normalised forms:
``\\frac{1}{2}`` and ``\\frac{2}{4}`` differ, as they do in verl.

Boundary: strings in, a float out; nothing here raises on any response text.
"""

from __future__ import annotations

import re
from typing import Any

CORRECT, WRONG = 1.0, 0.0

_INTEGER = re.compile(r"[-+]?\d+")
_A_SLASH_B = re.compile(r"(-?\d+)/(-?\d+)")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\boxed x``, or ``\\fbox{...}``), or None."""
    at = text.rfind("\\boxed")
    command = "\\boxed"
    if at < 0:
        at, command = text.rfind("\\fbox"), "\\fbox"
        if at < 0:
            return None
    rest = text[at + len(command) :]
    if rest.startswith(" "):  # \boxed 5$: up to the next dollar
        return rest[1:].split("$")[0]
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unclosed


def _fix_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``: one character after ``\\sqrt`` is its argument."""
    head, *parts = text.split("\\sqrt")
    out = [head]
    for part in parts:
        out.append("\\sqrt" + (part if not part or part[0] == "{" else "{" + part[0] + "}" + part[1:]))
    return "".join(out)


def _fix_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``; unchanged if malformed."""
    head, *parts = text.split("\\frac")
    out = [head]
    for part in parts:
        if part.startswith("{"):
            out.append("\\frac" + part)
            continue
        if len(part) < 2:
            return text
        numerator, rest = part[0], part[1:]
        denominator = rest if rest[0] == "{" else "{" + rest[0] + "}" + rest[1:]
        out.append("\\frac{" + numerator + "}" + denominator)
    return "".join(out)


def _fix_a_slash_b(text: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when the whole answer is one integer over another."""
    match = _A_SLASH_B.fullmatch(text)
    if match is None or str(int(match[1])) != match[1] or str(int(match[2])) != match[2]:
        return text
    return "\\frac{" + match[1] + "}{" + match[2] + "}"


def normalize(answer: str) -> str:
    """The canonical string of a MATH answer (the rules in the module docstring)."""
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = s.split("\\text{ ")[0]  # "10\text{ cm}": a unit on the right
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> " 5"
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "").rstrip(".")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    s = _fix_a_slash_b(s)
    if _INTEGER.fullmatch(s):
        sign = s[0] if s[0] in "+-" else ""
        s = sign + (s[len(sign) :].lstrip("0") or "0")
    return s


def is_equiv(answer: str | None, ground_truth: str | None) -> bool:
    """Whether two answers are the same after ``normalize`` (None equals only None, as in verl)."""
    if answer is None or ground_truth is None:
        return answer is None and ground_truth is None
    return normalize(answer) == normalize(ground_truth)


def score(solution: str, ground_truth: Any) -> float:
    """1.0 if ``solution``'s last boxed answer is equivalent to ``ground_truth``, else 0.0."""
    answer = last_boxed(solution)
    if answer is None:
        return WRONG
    return CORRECT if is_equiv(answer, str(ground_truth)) else WRONG


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """``score`` with verl's reward-function signature."""
    return score(solution_str, ground_truth)


__all__ = ["compute_score", "is_equiv", "last_boxed", "normalize", "score"]
