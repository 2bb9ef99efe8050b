"""One row of a prompt data set in verl's format, checked and made an ``Example``.

verl's RL data sets (``examples/data_preprocess/*.py``) are Parquet (here also JSONL) with one row
per prompt:

- ``data_source``: which data set the row came from (e.g. ``openai/gsm8k``), for the reward;
- ``prompt``: the chat messages, a list of ``{role, content}`` (role: system, user or assistant);
- ``reward_model``: ``{style, ground_truth}`` (style ``rule`` for a rule reward);
- ``extra_info``: anything else (split, index, the raw question), handed to the reward function.

The first three are required; ``extra_info`` may be missing (verl reads it with a default of {}).
Other columns (verl's ``ability``) are kept out of the ``Example`` and ignored.

Boundary: plain Python rows in (the reader in ``storage/datasets.py`` makes them); no files here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
OPTIONAL_COLUMNS = ("extra_info",)
ROLES = ("system", "user", "assistant")
FORMAT_HINT = (
    "verl's format has columns data_source, prompt (a list of {role, content} messages), "
    "reward_model ({style, ground_truth}) and extra_info"
)


@dataclass(frozen=True)
class Example:
    """One prompt and what its reward needs. ``index`` is the row's place in its split's files, in
    file order, before any filtering: it names the row in messages and logs."""

    index: int
    data_source: str
    messages: tuple[Mapping[str, str], ...]
    ground_truth: Any
    style: str = "rule"
    extra_info: Mapping[str, Any] = field(default_factory=dict)

    def chat(self) -> list[dict[str, str]]:
        """The messages as a fresh list of dicts, for a chat template."""
        return [dict(message) for message in self.messages]


def missing_columns(columns: Iterable[str]) -> list[str]:
    """The required columns that ``columns`` lacks, in a fixed order."""
    present = set(columns)
    return [name for name in REQUIRED_COLUMNS if name not in present]


def column_problem(columns: Iterable[str]) -> str | None:
    """One line naming the missing required columns and the format, or None."""
    missing = missing_columns(columns)
    if not missing:
        return None
    return f"missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)}; {FORMAT_HINT}"


def _messages(prompt: Any) -> tuple[dict[str, str], ...]:
    if isinstance(prompt, str) or not isinstance(prompt, Sequence) or not prompt:
        raise ValueError(
            f"prompt must be a non-empty list of {{role, content}} messages, got {type(prompt).__name__}"
        )
    out = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise ValueError(f"prompt[{i}] must be a {{role, content}} mapping, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"prompt[{i}].role={role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"prompt[{i}].content must be text, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return tuple(out)


def parse_row(row: Mapping[str, Any], index: int) -> Example:
    """The ``Example`` of one row; ValueError with one line naming the bad field."""
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        raise ValueError(f"data_source must be a non-empty string, got {source!r}")
    reward = row.get("reward_model")
    if not isinstance(reward, Mapping):
        raise ValueError(
            f"reward_model must be a {{style, ground_truth}} mapping, got {type(reward).__name__}"
        )
    if reward.get("ground_truth") is None:
        raise ValueError("reward_model.ground_truth is missing")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise ValueError(f"extra_info must be a mapping, got {type(extra).__name__}")
    return Example(
        index=index,
        data_source=source,
        messages=_messages(row.get("prompt")),
        ground_truth=reward["ground_truth"],
        style=str(reward.get("style") or "rule"),
        extra_info=dict(extra or {}),
    )


def parse_rows(
    rows: Iterable[Mapping[str, Any]], *, where: str, start: int = 0, offset: int = 0
) -> list[Example]:
    """Every row as an ``Example`` (indices from ``start``); ValueError with one line naming
    ``where`` (a file), the row (its place in the file: ``offset`` for the first of ``rows``) and the
    problem at the first bad row."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(parse_row(row, start + i))
        except ValueError as err:
            raise ValueError(f"{where}: row {offset + i}: {err}") from None
    return out


__all__ = [
    "FORMAT_HINT",
    "OPTIONAL_COLUMNS",
    "REQUIRED_COLUMNS",
    "Example",
    "column_problem",
    "missing_columns",
    "parse_row",
    "parse_rows",
]
