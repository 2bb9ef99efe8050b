"""The ``data.max_prompt_length`` policy: what happens to a prompt longer than the limit.

A prompt's length is the number of tokens of its chat messages as the model will see them, counted
by a tokenizer callable passed in (for a Hugging Face tokenizer, ``apply_chat_template(messages,
add_generation_prompt=True)``, as verl's ``filter_overlong_prompts`` measures it).

- ``filter`` (the default, verl's ``data.filter_overlong_prompts=True``): overlong prompts are
  dropped before training, counted, and reported in one log line (``LengthReport.line``);
- ``error``: any overlong prompt refuses the data set, naming the first one and its length.

Either way, a split left with no prompt at all is refused. Boundary: examples and a callable in,
examples out; no tokenizer or files here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from nereus_core.dataset.rows import Example

PromptTokenizer = Callable[[Sequence[Mapping[str, str]]], Sequence[int]]
Truncation = Literal["filter", "error"]


@dataclass(frozen=True)
class LengthReport:
    """What the policy did to one split."""

    split: str
    total: int
    filtered: int
    max_prompt_length: int
    longest: int  # tokens of the longest prompt seen, kept or not

    @property
    def kept(self) -> int:
        return self.total - self.filtered

    def line(self) -> str:
        """One log line: how many prompts were dropped and why."""
        return (
            f"data: {self.split}: filtered {self.filtered} of {self.total} prompts longer than "
            f"data.max_prompt_length={self.max_prompt_length} tokens (longest {self.longest}); "
            f"{self.kept} kept"
        )


def prompt_lengths(
    examples: Sequence[Example],
    tokenize: PromptTokenizer,
    *,
    max_prompt_length: int | None = None,
    chars_per_token: int | None = None,
) -> list[int]:
    """The token count of each example's chat messages. With ``chars_per_token`` (the tokenizer's
    longest token), a prompt of more than ``max_prompt_length * chars_per_token`` characters cannot
    fit and is not tokenized: its count is the lower bound ``chars // chars_per_token``. A tokenizer
    error (ValueError) names the row."""
    bound = (
        None if chars_per_token is None or max_prompt_length is None else max_prompt_length * chars_per_token
    )
    out = []
    for example in examples:
        chars = sum(len(m["content"]) for m in example.messages)
        if bound is not None and chars > bound:
            out.append(chars // chars_per_token)  # type: ignore[operator]
            continue
        try:
            out.append(len(tokenize(example.chat())))
        except ValueError as err:
            raise ValueError(f"row {example.index}: {err}") from None
    return out


def apply_max_prompt_length(
    examples: Sequence[Example],
    *,
    tokenize: PromptTokenizer,
    max_prompt_length: int,
    truncation: Truncation,
    split: str,
    chars_per_token: int | None = None,
) -> tuple[list[Example], LengthReport]:
    """The examples that fit ``max_prompt_length`` and a report; ValueError (one line) under
    ``error`` at the first overlong prompt, or when nothing is left (``chars_per_token``: see
    ``prompt_lengths``)."""
    try:
        lengths = prompt_lengths(
            examples, tokenize, max_prompt_length=max_prompt_length, chars_per_token=chars_per_token
        )
    except ValueError as err:
        raise ValueError(f"data: {split}: {err}") from None
    kept = [ex for ex, n in zip(examples, lengths, strict=True) if n <= max_prompt_length]
    report = LengthReport(
        split=split,
        total=len(examples),
        filtered=len(examples) - len(kept),
        max_prompt_length=max_prompt_length,
        longest=max(lengths, default=0),
    )
    if truncation == "error" and report.filtered:
        first = next(i for i, n in enumerate(lengths) if n > max_prompt_length)
        raise ValueError(
            f"data: {split}: row {examples[first].index} has {lengths[first]} prompt tokens, over "
            f"data.max_prompt_length={max_prompt_length} ({report.filtered} rows are); raise the limit "
            "or set data.truncation: filter to drop them"
        )
    if not kept:
        raise ValueError(
            f"data: {split}: all {report.total} prompts are longer than data.max_prompt_length="
            f"{max_prompt_length} tokens (shortest {min(lengths, default=0)}); raise the limit"
            if examples
            else f"data: {split}: the files hold no rows"
        )
    return kept, report


__all__ = ["LengthReport", "PromptTokenizer", "Truncation", "apply_max_prompt_length", "prompt_lengths"]
