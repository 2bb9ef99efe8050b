"""What ``reward.function`` may name, and calling it: the one owner of reward functions.

A reward function is either

- a text scorer with verl's signature ``(data_source, solution_str, ground_truth, extra_info)``
  returning a float, or a dict whose ``"score"`` is the reward and whose other keys are logged;
  the built-ins ``gsm8k``, ``gsm8k_flexible`` and ``math``, or a user's ``path/to/file.py:function``;
- or the demo's token scorer ``count``: ``nereus_core.count_task.rule_score`` (token ids in, a score per
  sequence out), registered here rather than re-implemented.

``spec_problem`` checks a name's form and a user's file's path without running anything;
``load_problem`` has a short-lived worker process import a user's file and check its function (the
config's check at load, one line for each problem); ``resolve`` turns a name into a ``RewardFn``: a
built-in called in this process, a user's function in a worker process of its own
(``nereus_core.rewards.worker``). ``score_text`` calls a text scorer for one response and turns
whatever it raises into a ``RewardError`` naming the function and the original message.

Boundary: a user's file is executed (as verl does with ``custom_reward_function``) only in a worker
process, never in this one; nothing here touches files but ``path_problem``'s look at the path.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nereus_core import count_task as task
from nereus_core.rewards import gsm8k, math_answer
from nereus_core.rewards.errors import RewardError
from nereus_core.rewards.isolation import WorkerSettings
from nereus_core.rewards.user_file import USER_FORM, first_line, path_problem
from nereus_core.rewards.worker import RewardWorker
from nereus_core.rewards.worker import load_problem as worker_problem

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


def form_problem(spec: str) -> str | None:
    """Why ``spec`` cannot name a reward function, by its form alone; None if it may."""
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


def spec_problem(spec: str) -> str | None:
    """Why ``spec`` cannot name a reward function: its form, and for a user's file its path (looked at,
    never imported); None if it may."""
    problem = form_problem(spec)
    if problem or spec in BUILTINS:
        return problem
    return path_problem(Path(spec.rpartition(":")[0]))


def load_problem(spec: str, settings: WorkerSettings) -> str | None:
    """Why ``spec`` cannot be had, one line: ``spec_problem``, then for a user's file what a worker
    process of its own (run by ``settings``, with ``settings.load_timeout_s`` to get ready) finds on
    importing it and checking the function; None if it loads."""
    problem = spec_problem(spec)
    if problem or spec in BUILTINS:
        return problem
    return worker_problem(spec, settings)


def resolve(spec: str, settings: WorkerSettings | None = None) -> RewardFn:
    """The reward function ``spec`` names: a built-in as it is, a user's function in a worker process
    of its own run by ``settings`` (default: ``WorkerSettings()``), started at its first call; the
    file is never imported in this process. ValueError with one line if ``spec_problem`` finds one."""
    problem = spec_problem(spec)
    if problem:
        raise ValueError(problem)
    if spec in TEXT_BUILTINS:
        return RewardFn(spec, TEXT_BUILTINS[spec], "text")
    if spec in TOKEN_BUILTINS:
        return RewardFn(spec, TOKEN_BUILTINS[spec], inputs_of(spec))
    return RewardFn(spec, RewardWorker(spec, settings), "text")


def log_to(reward: RewardFn, path: str) -> None:
    """Where a user's function's worker writes what it prints, from its next start (the one running
    now is ended); nothing for a built-in, which runs in this process."""
    if isinstance(reward.fn, RewardWorker):
        reward.fn.log_to(path)


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
    "WorkerSettings",
    "form_problem",
    "inputs_of",
    "load_problem",
    "log_to",
    "resolve",
    "score_text",
    "score_tokens",
    "spec_problem",
]
