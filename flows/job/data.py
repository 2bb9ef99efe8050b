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
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from nereus_core import prompt_source
from nereus_core.config import ConfigError, NereusConfig
from nereus_core.dataset.rows import Example
from nereus_core.dataset.sampler import Sampler
from nereus_core.engine.hf_load import hf_source
from nereus_core.hf.tokenizer import (
    TokenizerError,
    chat_prompt_ids,
    decode_text,
    load_tokenizer,
    longest_token_chars,
    pad_token_id,
    stop_token_ids,
    vocab_problem,
)
from nereus_core.model.hf_dir import weights_problem
from nereus_core.rewards.registry import RewardError, RewardFn, log_to
from nereus_core.rl import rollout
from storage.datasets import DatasetError, load_data

_LOG = logging.getLogger("nereus.data")
REWARD_LOG = "logs/reward_worker.log"  # in the run directory: what a user's reward function prints


@dataclass(frozen=True)
class JobData:
    """The training prompts of every step and, when the config validates, the validation prompts."""

    train: prompt_source.PromptSource
    val: prompt_source.DatasetSource | None = None


class Prepared:
    """The job data the CLI prepared before the flow started (so that bad data ends in one line before
    Prefect and Dask do), handed to the flow as its ``prepared`` parameter so that it is made once.

    Slots and no ``__dict__``: Prefect stores a flow's parameters as JSON and gives up on this one
    at once (a placeholder) instead of copying every prompt and tokenizer into its encoder."""

    __slots__ = ("data",)

    def __init__(self, data: JobData) -> None:
        self.data = data


def prepare(cfg: NereusConfig, log: Callable[[str], None] = _LOG.info) -> Prepared:
    """Check the model's files and make the prompt sources now, for the flow's ``prepared``
    parameter. ConfigError in one line."""
    problem = model_files_problem(cfg)
    if problem:
        raise ConfigError(problem)
    return Prepared(job_data(cfg, log))


def model_files_problem(cfg: NereusConfig) -> str | None:
    """Why a model directory's safetensors cannot give its model (``hf_dir.weights_problem``: headers
    only, no device touched), naming the config key, the file and the tensor; or None."""
    for model, key in (("actor", "model.path"), ("critic", "critic.path"), ("reward", "reward.model_path")):
        source = hf_source(cfg, model)
        if source is None or source.fresh_head:
            continue  # a critic on the actor's backbone: the actor's check covers it
        problem = weights_problem(source.path, cfg.models[model])
        if problem:
            return f"{key}: {problem}"
    return None


def job_data(
    cfg: NereusConfig,
    log: Callable[[str], None] = _LOG.info,
    *,
    run_dir: str | None = None,
    prepared: Prepared | None = None,
) -> JobData:
    """The prompt sources of ``cfg`` (see the module docstring), or ``prepared``'s when given (the
    CLI made them for this config); ConfigError in one line. With ``run_dir``, a user's reward
    function's worker writes what it prints to ``run_dir/logs/reward_worker.log`` from its next start
    (before: a temp file)."""
    ready = prepared.data if prepared is not None else None
    if ready is None and cfg.data is None:
        return JobData(prompt_source.CountSource(cfg.job.task_settings, prompts_per_step(cfg), cfg.job.seed))
    try:
        data = ready or _dataset_sources(cfg, log)
    except (TokenizerError, DatasetError, RewardError, ValueError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    if run_dir is not None and isinstance(data.train, prompt_source.DatasetSource):
        log_to(data.train.reward, os.path.join(os.path.abspath(run_dir), REWARD_LOG))
    return data


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

    splits = load_data(data, tokenize=render, chars_per_token=longest_token_chars(tokenizer), log=log)
    assert cfg.reward is not None  # the config refuses data without a text reward (sections_problem)
    reward = cfg.reward.resolve()
    _try_reward(reward, splits["train"].examples[0])
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


def _try_reward(reward: RewardFn, example: Example) -> None:
    """One call of ``reward`` on an empty response (what a response of only EOS decodes to) to the
    first training row, before anything starts: a function that hangs, exits, raises or returns no
    finite score fails here in one line instead of at the first step."""
    try:
        prompt_source.score_row(reward, example, "")
    except RewardError as err:
        raise RewardError(f"{err}, tried on an empty response before the start") from None


__all__ = ["JobData", "job_data", "model_files_problem", "prepare"]
