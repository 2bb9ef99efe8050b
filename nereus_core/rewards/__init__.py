"""Reward functions: verl's GSM8K and MATH rule scorers, the demo's ``count``, and a user's own file.

``registry`` owns what ``reward.function`` may name and how one is called; ``gsm8k`` and
``math_answer`` are the built-in text scorers; ``worker`` runs a user's function in a process of
its own (``worker_process`` is what runs inside it, ``isolation`` what it may see and use: its
environment, limits and log). The registry's names are imported on first use (PEP 562), so that a
reward worker, which imports ``nereus_core.rewards.worker_process``, does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_REGISTRY = (
    "BUILTINS",
    "RewardError",
    "RewardFn",
    "Scored",
    "resolve",
    "score_text",
    "score_tokens",
    "spec_problem",
)


def __getattr__(name: str) -> Any:
    if name in _REGISTRY:
        return getattr(importlib.import_module("nereus_core.rewards.registry"), name)
    if name in ("gsm8k", "math_answer", "registry"):
        return importlib.import_module(f"nereus_core.rewards.{name}")
    raise AttributeError(f"module 'nereus_core.rewards' has no attribute {name!r}")


__all__ = list(_REGISTRY)
