"""nereus_core/prompt_source.py: the count task's source gives the task's own prompts and scores; a
data set's source gives the sampler's batch left-padded, decodes only each response's real tokens and
scores them with the reward function, whose errors are named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nereus_core import prompt_source
from nereus_core.count_task import TaskSettings, make_prompts, rule_score
from nereus_core.dataset.rows import Example
from nereus_core.dataset.sampler import Sampler
from nereus_core.rewards import registry
from nereus_core.rl import rollout

PAD, EOS = 0, 9
# A toy vocabulary: id i decodes to its character; EOS and PAD are special (skipped).
CHARS = {1: "#", 2: "1", 3: "8", 4: " ", 5: "7", 6: "2", 7: "x"}


def decode(ids: list[int]) -> str:
    return "".join(CHARS.get(i, "") for i in ids)


def example(i: int, truth: str, source: str = "openai/gsm8k") -> Example:
    return Example(i, source, ({"role": "user", "content": f"q{i}"},), truth, extra_info={"index": i})


def dataset_source(reward: str = "gsm8k", **sampler: object) -> prompt_source.DatasetSource:
    examples = (example(0, "18"), example(1, "72"), example(2, "18", "other"), example(3, "7"))
    prompts = ((5, 5, 5), (6,), (5, 6), (7, 7, 7, 7))
    return prompt_source.DatasetSource(
        examples=examples,
        prompt_ids=prompts,
        sampler=Sampler(4, 2, **sampler),  # type: ignore[arg-type]
        reward=registry.resolve(reward),
        decode=decode,
        stopping=rollout.Stopping(eos_ids=(EOS,), pad_id=PAD),
    )


def test_the_count_source_is_the_count_task() -> None:
    settings = TaskSettings(prompt_len=5, response_len=6)
    source = prompt_source.CountSource(settings, batch_size=4, seed=3)
    batch = source.batch(7)
    assert torch.equal(batch.prompts, make_prompts(settings, 4, 3, 7))
    assert batch.prompt_mask is None and batch.examples == () and source.stopping == rollout.NO_STOP
    responses = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(0))
    scores = source.score(batch, responses, torch.ones(4, 6))
    assert torch.equal(scores.score, rule_score(batch.prompts, responses)) and scores.texts is None


def test_left_pad_right_aligns_each_row() -> None:
    ids, mask = prompt_source.left_pad([[5, 6, 7], [8]], pad_id=PAD)
    assert ids.tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="no empty row"):
        prompt_source.left_pad([[1], []], 0)


def test_a_dataset_batch_is_the_samplers_batch_left_padded() -> None:
    source = dataset_source(seed=5)
    for step in (0, 1, 2, 7):
        rows = Sampler(4, 2, seed=5).batch(step)
        batch = source.batch(step)
        assert [ex.index for ex in batch.examples] == rows  # a resumed step gets the same rows
        expected, _ = prompt_source.left_pad([source.prompt_ids[i] for i in rows], PAD)
        assert torch.equal(batch.prompts, expected)
        lengths = [len(source.prompt_ids[i]) for i in rows]
        if len(set(lengths)) > 1:
            assert batch.prompt_mask is not None
            assert batch.prompt_mask.sum(1).tolist() == lengths
        else:
            assert batch.prompt_mask is None


def test_responses_are_decoded_up_to_their_stop_and_scored_by_the_reward() -> None:
    source = dataset_source(shuffle=False)
    batch = source.batch(0)  # examples 0 (truth 18) and 1 (truth 72)
    # Row 0: "#### 18" then EOS, then tokens after the stop that must not be read ("7" would
    # make it "#### 187"). Row 1: "#### 27" and more, no stop (it hits the limit): wrong, 72 is right.
    responses = torch.tensor([[1, 1, 1, 1, 4, 2, 3, EOS, 5, 5], [1, 1, 1, 1, 4, 6, 5, 7, 7, 7]])
    mask = rollout.response_mask(responses, (EOS,))
    scores = source.score(batch, responses, mask)
    assert scores.texts == ("#### 18", "#### 27xxx")
    assert scores.score.tolist() == [1.0, 0.0]
    assert (
        prompt_source.decode_responses(responses, torch.ones_like(mask), decode)[0] == "#### 1877"
    )  # unmasked


def test_a_raising_reward_function_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad_reward.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    raise KeyError('no answer field')\n"
    )
    source = dataset_source(f"{path}:score", shuffle=False)
    batch = source.batch(0)
    responses = torch.tensor([[1, EOS], [2, EOS]])
    with pytest.raises(registry.RewardError, match=r"bad_reward.py:score raised KeyError: 'no answer field'"):
        source.score(batch, responses, rollout.response_mask(responses, (EOS,)))


def test_dict_extras_are_averaged_and_validation_means_are_per_data_source(tmp_path: Path) -> None:
    path = tmp_path / "reward.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': float(extra_info['index']), 'bonus': 2.0 * extra_info['index']}\n"
    )
    source = dataset_source(f"{path}:score", shuffle=False, drop_last=False)
    responses = torch.tensor([[1, EOS], [2, EOS]])
    mask = rollout.response_mask(responses, (EOS,))
    scored = [(b, source.score(b, responses, mask)) for b in source.val_batches()]
    assert [s.score.tolist() for _, s in scored] == [[0.0, 1.0], [2.0, 3.0]]
    assert scored[0][1].extras == {"bonus": 1.0}
    # openai/gsm8k: examples 0, 1, 3; other: example 2.
    assert prompt_source.mean_by_source(scored) == {"openai/gsm8k": pytest.approx(4 / 3), "other": 2.0}


def test_a_source_refuses_mismatched_rows_and_token_rewards() -> None:
    good = dataset_source()
    with pytest.raises(ValueError, match="must be the same rows"):
        prompt_source.DatasetSource(
            good.examples, good.prompt_ids[:3], good.sampler, good.reward, decode, good.stopping
        )
    with pytest.raises(ValueError, match="scores token ids"):
        prompt_source.DatasetSource(
            good.examples, good.prompt_ids, good.sampler, registry.resolve("count"), decode, good.stopping
        )


def test_a_repeated_batch_keeps_each_prompts_copies_side_by_side() -> None:
    batch = dataset_source(shuffle=False).batch(1)  # examples 2 and 3, of 2 and 4 tokens
    twice = batch.repeated(2)
    assert [ex.index for ex in twice.examples] == [2, 2, 3, 3]
    assert torch.equal(twice.prompts, batch.prompts.repeat_interleave(2, dim=0))
    assert twice.prompt_mask is not None and batch.prompt_mask is not None
    assert twice.prompt_mask.sum(1).tolist() == [2, 2, 4, 4]
    assert batch.repeated(1) is batch
