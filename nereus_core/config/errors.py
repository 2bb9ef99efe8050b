"""A pydantic ``ValidationError`` of the config as the one line the user sees: where, the bad value,
and what would be valid.

Boundary: wording only; the config's models (``nereus_core.config``) are passed in, never imported.
"""

from __future__ import annotations

import re
from difflib import get_close_matches
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

from nereus_core.config.base import shown
from nereus_core.plan import MODEL_STAGES

_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
_BOUND_CTX = {"greater_than_equal": "ge", "greater_than": "gt", "less_than_equal": "le", "less_than": "lt"}


def _where(loc: tuple[Any, ...]) -> str:
    """``('plan', 'actor/train', 'devices', 1)`` -> ``plan.actor/train.devices[1]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _section_fields(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the config section at ``loc`` (empty if it is not a model)."""
    node: Any = root
    for part in loc:
        if isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            node = node.model_fields[part].annotation
        elif get_origin(node) is dict:
            node = get_args(node)[1]
        else:
            return []
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def one_line(err: ValidationError, root: type[BaseModel]) -> str:
    """The first error of ``err`` as one line: where, the bad value, and what would be valid."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    kind = first["type"]
    ctx = first.get("ctx") or {}
    if loc and loc[-1] == "[key]" and loc[0] == "plan":
        return f"{_where(loc[:-1])}: unknown model-stage; valid: {', '.join(MODEL_STAGES)}"
    where = _where(loc)
    if kind == "extra_forbidden":
        valid = _section_fields(root, loc[:-1])
        near = get_close_matches(str(loc[-1]), valid, n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        return f"{where}: unknown field; {hint}valid fields: {', '.join(valid)}"
    if kind.startswith("missing"):
        return f"{where}: required field is missing"
    if kind in _BOUNDS:
        msg = f"must be {_BOUNDS[kind]} {ctx[_BOUND_CTX[kind]]}"
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        if first.get("input") is None:
            return f"{where}: is empty; give it fields or remove it"
        msg = f"must be a mapping, got {type(first.get('input')).__name__}"
    elif kind in ("tuple_type", "list_type"):
        msg = "must be a list, e.g. [0, 1]"
    elif kind == "byte_size":
        msg = "is not a size; use bytes or a number with a unit, e.g. 2GiB or 512MB"
    else:
        msg = first["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        msg = re.sub(r"^(Input|String|List|Tuple|Value) should", "must", msg)
    if not where:
        return msg
    if msg.startswith(f"{where}.") or msg.startswith(f"{where}="):
        return msg  # the validator already named the field in full
    bad = first.get("input")
    if kind != "value_error" and not isinstance(bad, dict):
        return f"{where}={shown(bad)}: {msg}"
    return f"{where}: {msg}"
