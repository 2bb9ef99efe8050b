"""What ``reward.function`` may name, and calling it: the one owner of reward functions.

A reward function is either

- a text scorer with verl's signature ``(data_source, solution_str, ground_truth, extra_info)``
  returning a float, or a dict whose ``"score"`` is the reward and whose other keys are logged;
  the built-ins ``gsm8k``, ``gsm8k_flexible`` and ``math``, or a user's ``path/to/file.py:function``;
- or the demo's token scorer ``count``: ``nereus_core.count_task.rule_score`` (token ids in, a score per
  sequence out), registered here rather than re-implemented.

``resolve`` turns a name into a ``RewardFn`` and checks a user's file and function when the config
is loaded (one line for each problem); ``score_text`` calls a text scorer for one response and turns
whatever it raises into a ``RewardError`` naming the function and the original message.

Boundary: loading a user's file executes it (as verl does with ``custom_reward_function``); nothing
else here touches files.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from nereus_core import count_task as task
from nereus_core.rewards import gsm8k, math_answer
from nereus_core.rewards.errors import RewardError
from nereus_core.rewards.user_file import USER_FORM, first_line, load_function

TEXT_BUILTINS: dict[str, Callable[..., Any]] = {
    "gsm8k": gsm8k.compute_score,
    "gsm8k_flexible": gsm8k.compute_score_flexible,
    "math": math_answer.compute_score,
}
TOKEN_BUILTINS: dict[str, Callable[..., Any]] = {"count": task.rule_score}
BUILTINS = (*TEXT_BUILTINS, *TOKEN_BUILTINS)


@dataclass(frozen=True)
class RewardFn:
    """A resolved reward function: its name as configured, the callable, and what it reads."""

    name: str
    fn: Callable[..., Any] = field(repr=False, compare=False)
    inputs: Literal["text", "tokens"]


@dataclass(frozen=True)
class Scored:
    """One response's reward and the extra values a dict-returning function gave (to be logged)."""

    score: float
    extras: Mapping[str, Any] = field(default_factory=dict)


def spec_problem(spec: str) -> str | None:
    """Why ``spec`` cannot name a reward function, without touching files; None if it may."""
    if spec in BUILTINS:
        return None
    path, colon, name = spec.rpartition(":")
    if not colon or not path or not name:
        return f"is neither a built-in ({', '.join(BUILTINS)}) nor {USER_FORM}"
    if not path.endswith(".py"):
        return f"names {path!r}, which is not a .py file; use {USER_FORM}"
    if not name.isidentifier():
        return f"names {name!r}, which is not a Python function name; use {USER_FORM}"
    return None


def inputs_of(spec: str) -> Literal["text", "tokens"]:
    """What the function ``spec`` names reads, without loading it."""
    return "tokens" if spec in TOKEN_BUILTINS else "text"


def resolve(spec: str) -> RewardFn:
    """The reward function ``spec`` names; ValueError with one line if it cannot be had."""
    problem = spec_problem(spec)
    if problem:
        raise ValueError(problem)
    if spec in TEXT_BUILTINS:
        return RewardFn(spec, TEXT_BUILTINS[spec], "text")
    if spec in TOKEN_BUILTINS:
        return RewardFn(spec, TOKEN_BUILTINS[spec], inputs_of(spec))
    fn = load_function(spec)
    return RewardFn(spec, fn, "text")


def isolated(reward: RewardFn, timeout_s: float) -> RewardFn:
    """``reward`` as the job calls it: a built-in as it is, a user's function in a worker process of
    its own with ``timeout_s`` per call (``nereus_core.rewards.worker``)."""
    if reward.name in BUILTINS:
        return reward
    from nereus_core.rewards.worker import RewardWorker

    return RewardFn(reward.name, RewardWorker(reward.name, timeout_s), reward.inputs)


def score_text(
    reward: RewardFn, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any
) -> Scored:
    """Call a text reward function on one response; RewardError (one line) if it raises or returns
    something that is not a finite number or a dict with a numeric ``"score"``."""
    if reward.inputs != "text":
        raise RewardError(f"reward function {reward.name} scores token ids, not text; use a text scorer")
    try:
        out = reward.fn(data_source, solution_str, ground_truth, extra_info)
    except RewardError:  # a reward worker's own one line (a timeout, an exit)
        raise
    except Exception as err:  # the user's code: any error, named
        raise RewardError(
            f"reward function {reward.name} raised {type(err).__name__}: {first_line(err)}"
        ) from err
    extras: dict[str, Any] = {}
    if isinstance(out, Mapping):
        if "score" not in out:
            keys = ", ".join(map(repr, list(out)[:5])) or "none"
            raise RewardError(
                f"reward function {reward.name} returned a dict without a 'score' key (keys: {keys}); "
                "return a finite float or a dict with a 'score'"
            )
        extras = {k: v for k, v in out.items() if k != "score"}
        out = out["score"]
    if not isinstance(out, numbers.Real) or not math.isfinite(out):
        raise RewardError(
            f"reward function {reward.name} returned {type(out).__name__} {str(out)[:40]!r}; "
            "return a finite float or a dict with a 'score'"
        )
    return Scored(float(out), extras)


def score_tokens(reward: RewardFn, prompts_bp: Any, responses_bt: Any) -> Any:
    """Call a token reward function (``count``) on a batch; RewardError (one line) if it raises."""
    if reward.inputs != "tokens":
        raise RewardError(f"reward function {reward.name} scores text, not token ids; decode first")
    try:
        return reward.fn(prompts_bp, responses_bt)
    except Exception as err:
        raise RewardError(
            f"reward function {reward.name} raised {type(err).__name__}: {first_line(err)}"
        ) from err


__all__ = [
    "BUILTINS",
    "RewardError",
    "RewardFn",
    "Scored",
    "inputs_of",
    "isolated",
    "resolve",
    "score_text",
    "score_tokens",
    "spec_problem",
]
