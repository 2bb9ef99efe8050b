"""The job's prompt sources, made from its config before anything starts on the pool.

    no data section:  the count task (nereus_core.prompt_source.CountSource)
    data section:     tokenizer (model.tokenizer, else model.path) -> stop ids, pad id
                      -> train/val files (storage/datasets.py: columns, rows, max_prompt_length policy,
                         one log line per split) -> chat prompts rendered once -> DatasetSource each

A problem found here (a tokenizer that does not load or has more ids than the model, a bad file or
row, a split the length policy empties or that holds fewer prompts than one batch) is one
``ConfigError`` line; a missing tokenizer or chat template is refused at config load already.

Boundary: reading and loading only; what a source does with its prompts is nereus_core's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from nereus_core import prompt_source
from nereus_core.config import ConfigError, NereusConfig
from nereus_core.dataset.sampler import Sampler
from nereus_core.hf.tokenizer import (
    TokenizerError,
    chat_prompt_ids,
    decode_text,
    load_tokenizer,
    pad_token_id,
    stop_token_ids,
    vocab_problem,
)
from nereus_core.rl import rollout
from storage.datasets import DatasetError, load_data

_LOG = logging.getLogger("nereus.data")


@dataclass(frozen=True)
class JobData:
    """The training prompts of every step and, when the config validates, the validation prompts."""

    train: prompt_source.PromptSource
    val: prompt_source.DatasetSource | None = None


def job_data(cfg: NereusConfig, log: Callable[[str], None] = _LOG.info) -> JobData:
    """The prompt sources of ``cfg`` (see the module docstring); ConfigError in one line."""
    if cfg.data is None:
        return JobData(prompt_source.CountSource(cfg.job.task_settings, prompts_per_step(cfg), cfg.job.seed))
    try:
        return _dataset_sources(cfg, log)
    except (TokenizerError, DatasetError, ValueError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None


def prompts_per_step(cfg: NereusConfig) -> int:
    """Distinct prompts a step samples: the batch, or its groups (GRPO: group_size responses each)."""
    return cfg.job.batch_size // cfg.algorithm.group_size


def _dataset_sources(cfg: NereusConfig, log: Callable[[str], None]) -> JobData:
    data, where = cfg.data, cfg.model.tokenizer_dir
    assert data is not None and where is not None  # the config refuses data without a tokenizer
    tokenizer = load_tokenizer(where)
    problem = vocab_problem(tokenizer, cfg.model.vocab_size)
    if problem:
        raise ConfigError(problem)
    stops = stop_token_ids(tokenizer, cfg.model.path)
    stopping = rollout.Stopping(eos_ids=stops, pad_id=pad_token_id(tokenizer, stops))
    rendered: dict[str, list[int]] = {}

    def render(messages: Sequence[Mapping[str, str]]) -> list[int]:
        # The length policy and the prompts read the same rendering: each chat is rendered once.
        key = repr([(m["role"], m["content"]) for m in messages])
        if key not in rendered:
            rendered[key] = chat_prompt_ids(tokenizer, [messages])[0]
        return rendered[key]

    splits = load_data(data, tokenize=render, log=log)
    assert cfg.reward is not None  # the config refuses data without a text reward (sections_problem)
    reward = cfg.reward.resolve()
    decode = partial(decode_text, tokenizer)

    def source(split: str, sampler: Sampler) -> prompt_source.DatasetSource:
        examples = tuple(splits[split].examples)
        return prompt_source.DatasetSource(
            examples=examples,
            prompt_ids=tuple(tuple(render(ex.chat())) for ex in examples),
            sampler=sampler,
            reward=reward,
            decode=decode,
            stopping=stopping,
        )

    train_size = len(splits["train"].examples)
    per_step = prompts_per_step(cfg)
    train = source("train", Sampler(train_size, per_step, seed=data.seed, shuffle=data.shuffle))
    val = None
    if "val" in splits:
        size = len(splits["val"].examples)
        per = (cfg.validation.batch_size if cfg.validation else None) or size
        val = source("val", Sampler(size, min(per, size), shuffle=False, drop_last=False))
    return JobData(train, val)


__all__ = ["JobData", "job_data"]
