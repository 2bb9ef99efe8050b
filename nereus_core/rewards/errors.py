"""The one error a reward function's failure becomes (stdlib only: a reward worker raises it too)."""

from __future__ import annotations


class RewardError(RuntimeError):
    """A reward function failed on a response; ``str(err)`` is one line naming it."""


__all__ = ["RewardError"]
