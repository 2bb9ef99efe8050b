"""Where a step's prompts come from and how its responses are scored: the one interface the PPO
step asks (``batch(step)``, ``score(...)``, ``stopping``), with two sources behind it.

- ``CountSource``: the demo's ``count`` task (``nereus_core.count_task``): random digit prompts seeded by
  (seed, step), no stop ids (every response runs to the limit), scored by ``rule_score`` through the
  reward registry. Exactly the numbers the job produced before this interface existed.
- ``DatasetSource``: prompts in verl's format (``nereus_core.dataset``), rendered once with the
  tokenizer's chat template, left-padded with the pad id to the batch's longest prompt (``prompt_mask``
  0 on the pads); step ``s`` takes the sampler's batch ``s``, so a resumed job gets the batch an
  uninterrupted one would. Responses end at the tokenizer's stop ids; they are decoded with the
  special tokens skipped, up to each row's own length (the response mask), and scored by
  ``reward.function`` with verl's arguments ``(data_source, solution_str, ground_truth,
  extra_info)`` per row. Validation walks its prompts in file order (``val_batches``).

verl pads every prompt to ``data.max_prompt_length``; padding to the batch's longest instead gives
the same results (padding changes no result: tests/core/rl/test_rollout.py) with fewer columns.

Boundary: pure; examples, token ids and callables in. Reading files and loading the tokenizer are
the caller's (``flows/job/data.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from nereus_core.count_task import TaskSettings, make_prompts
from nereus_core.dataset.rows import Example
from nereus_core.dataset.sampler import Sampler
from nereus_core.rewards import registry
from nereus_core.rl import rollout

Decode = Callable[[Sequence[int]], str]  # token ids -> text, special tokens skipped


@dataclass(frozen=True)
class PromptBatch:
    """One step's prompts: ``prompts`` ``[b, P]`` left-padded, ``prompt_mask`` ``[b, P]`` (None: no
    padding), and the examples they came from (empty for the count task)."""

    prompts: torch.Tensor
    prompt_mask: torch.Tensor | None = None
    examples: tuple[Example, ...] = ()

    def repeated(self, group: int) -> PromptBatch:
        """Each prompt ``group`` times, the copies side by side (GRPO's groups; ``rollout.grouped``)."""
        if group == 1:
            return self
        mask = None if self.prompt_mask is None else rollout.grouped(self.prompt_mask, group)
        examples = tuple(ex for ex in self.examples for _ in range(group))
        return PromptBatch(rollout.grouped(self.prompts, group), mask, examples)


@dataclass(frozen=True)
class Scores:
    """A batch's rule scores ``[b]``, the decoded responses (None: the task reads token ids) and the
    extra values dict-returning reward functions gave, averaged per key over the rows that had it."""

    score: torch.Tensor
    texts: tuple[str, ...] | None = None
    extras: Mapping[str, float] = field(default_factory=dict)


class PromptSource(Protocol):
    """What the step asks for its prompts, stop ids and rule scores."""

    @property
    def stopping(self) -> rollout.Stopping: ...

    def batch(self, step: int) -> PromptBatch: ...

    def score(self, batch: PromptBatch, responses_bt: torch.Tensor, mask_bt: torch.Tensor) -> Scores: ...


@dataclass(frozen=True)
class CountSource:
    """The demo's count task: ``batch_size`` digit prompts per step, scored by its token rule."""

    settings: TaskSettings
    batch_size: int
    seed: int
    reward: registry.RewardFn = field(default_factory=lambda: registry.resolve("count"))
    stopping: rollout.Stopping = rollout.NO_STOP  # the job's: none; tests give stop ids to vary the lengths

    def batch(self, step: int) -> PromptBatch:
        return PromptBatch(make_prompts(self.settings, self.batch_size, self.seed, step))

    def score(self, batch: PromptBatch, responses_bt: torch.Tensor, mask_bt: torch.Tensor) -> Scores:
        # The rule reads every column: with stop ids, the pads after a stop are non-digits (score 0).
        return Scores(registry.score_tokens(self.reward, batch.prompts, responses_bt))


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [b, P], mask [b, P])``: each row right-aligned to the longest, ``pad_id`` before it."""
    if not rows or not all(rows):
        raise ValueError("left_pad needs at least one row and no empty row")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(list(row), dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


def decode_responses(responses_bt: torch.Tensor, mask_bt: torch.Tensor, decode: Decode) -> tuple[str, ...]:
    """Each response's real tokens (``mask_bt``: 1 up to and including its stop token) as text."""
    lengths = mask_bt.sum(dim=1).round().long().tolist()
    return tuple(decode(row[:n]) for row, n in zip(responses_bt.tolist(), lengths, strict=True))


@dataclass(frozen=True)
class DatasetSource:
    """Prompts of a verl-format split, rendered to ``prompt_ids`` (one list per example, same order),
    batched by ``sampler``, stopped by ``stopping`` and scored by ``reward`` on decoded text."""

    examples: tuple[Example, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    sampler: Sampler
    reward: registry.RewardFn
    decode: Decode = field(repr=False)
    stopping: rollout.Stopping = rollout.NO_STOP

    def __post_init__(self) -> None:
        if len(self.examples) != len(self.prompt_ids) or len(self.examples) != self.sampler.size:
            raise ValueError(
                f"{len(self.examples)} examples, {len(self.prompt_ids)} rendered prompts and a sampler "
                f"of {self.sampler.size}: they must be the same rows"
            )
        if self.reward.inputs != "text":
            raise ValueError(f"reward function {self.reward.name} scores token ids; a data set needs text")

    def rows(self, positions: Sequence[int]) -> PromptBatch:
        """The prompts of the examples at ``positions``, left-padded."""
        ids, mask = left_pad([self.prompt_ids[i] for i in positions], self.stopping.pad_id)
        return PromptBatch(
            ids, None if bool(mask.all()) else mask, tuple(self.examples[i] for i in positions)
        )

    def batch(self, step: int) -> PromptBatch:
        return self.rows(self.sampler.batch(step))

    def val_batches(self) -> Iterator[PromptBatch]:
        """Every prompt once, in order, in the sampler's batches (the last one may be short)."""
        for k in range(self.sampler.batches_per_epoch):
            yield self.batch(k)

    def score(self, batch: PromptBatch, responses_bt: torch.Tensor, mask_bt: torch.Tensor) -> Scores:
        """Each decoded response scored by ``reward``; a function that raises raises RewardError
        naming it (the step fails, the last checkpoint stays)."""
        texts = decode_responses(responses_bt, mask_bt, self.decode)
        scored = [score_row(self.reward, ex, text) for ex, text in zip(batch.examples, texts, strict=True)]
        return Scores(
            torch.tensor([s.score for s in scored], dtype=torch.float32), texts, _mean_extras(scored)
        )


def score_row(reward: registry.RewardFn, example: Example, text: str) -> registry.Scored:
    """``reward`` on one response to ``example``; its RewardError names the row too."""
    try:
        return registry.score_text(
            reward, example.data_source, text, example.ground_truth, dict(example.extra_info)
        )
    except registry.RewardError as err:
        raise registry.RewardError(f"{err} (on data row {example.index})") from None


def _mean_extras(scored: Sequence[registry.Scored]) -> dict[str, float]:
    """The numeric extras of dict-returning functions, each averaged over the rows that gave it."""
    sums: dict[str, list[float]] = {}
    for s in scored:
        for key, value in s.extras.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                sums.setdefault(key, []).append(float(value))
    return {key: sum(v) / len(v) for key, v in sums.items()}


def mean_by_source(batches: Sequence[tuple[PromptBatch, Scores]]) -> dict[str, float]:
    """The mean score per ``data_source`` over scored batches (validation's figure)."""
    seen: dict[str, list[float]] = {}
    for batch, scores in batches:
        for ex, value in zip(batch.examples, scores.score.tolist(), strict=True):
            seen.setdefault(ex.data_source, []).append(value)
    return {source: sum(v) / len(v) for source, v in sorted(seen.items())}


__all__ = [
    "CountSource",
    "DatasetSource",
    "PromptBatch",
    "PromptSource",
    "Scores",
    "decode_responses",
    "left_pad",
    "mean_by_source",
    "score_row",
]
