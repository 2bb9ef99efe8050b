"""What a device call works for and how much: the model-stage its arguments name, and its tokens.

Boundary: read-only looks at a call's arguments, for ``tasks.runtime.device_pool``'s labels and
deadlines; nothing here runs or decides anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch


def call_label(kwargs: Mapping[str, Any]) -> str:
    """The model-stage a call works for, where its arguments say it: the resident model's ``name``
    (``actor/train``, ...) or a reshard job's."""
    name = kwargs.get("name", getattr(kwargs.get("job"), "name", None))
    return name if isinstance(name, str) else ""


def call_tokens(values: Iterable[Any], depth: int = 0) -> int:
    """Elements of the integer tensors among ``values`` (token ids and their masks), looking into
    dicts, lists and tuples: what a forward or train call processes; weights (float) do not count."""
    n = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            n += 0 if v.is_floating_point() or v.is_complex() else v.numel()
        elif isinstance(v, dict) and depth < 3:
            n += call_tokens(v.values(), depth + 1)
        elif isinstance(v, list | tuple) and depth < 3:
            n += call_tokens(v, depth + 1)
    return n
