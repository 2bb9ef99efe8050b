"""nereus_core.engine.sampling: what a vLLM engine is asked, and its answers as the rollout's tensors."""

from __future__ import annotations

import pytest
import torch

from nereus_core.engine.sampling import (
    SEED_STRIDE,
    SamplingRequest,
    distinct_prompts,
    prompt_lists,
    response_tensors,
)


def test_left_pads_are_stripped_from_each_prompt() -> None:
    prompts = torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert prompt_lists(prompts, mask) == [[5, 6], [1, 2, 3, 4]]
    assert prompt_lists(prompts, None) == [[0, 0, 5, 6], [1, 2, 3, 4]]


def test_groups_of_copies_are_asked_once() -> None:
    rows = [[1, 2]] * 3 + [[3]] * 3
    assert distinct_prompts(rows, 3) == [[1, 2], [3]]
    assert distinct_prompts(rows, 2) is None  # [1, 2] and [3] meet in the second pair
    assert distinct_prompts(rows, 1) is None and distinct_prompts(rows[:5], 3) is None


def test_params_map_the_job_settings_and_give_each_row_its_seed() -> None:
    request = SamplingRequest(max_new_tokens=8, temperature=0.7, stop_ids=(2, 5), seed=3, n=4)
    p = request.params(row=2)
    assert (p["n"], p["temperature"], p["max_tokens"], p["stop_token_ids"]) == (4, 0.7, 8, [2, 5])
    assert p["logprobs"] == 0 and not p["ignore_eos"] and p["seed"] == 3 * SEED_STRIDE + 2
    assert SamplingRequest(max_new_tokens=8).params(0)["ignore_eos"]  # no stop ids: the full length


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"max_new_tokens": 4, "top_p": 0.0}])
def test_bad_requests_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingRequest(**bad)


def test_answers_are_right_padded() -> None:
    ids, logp = response_tensors([([7, 2], [-0.5, -1.0]), ([4, 4, 4], [-0.1, -0.2, -0.3])], 3, pad_id=9)
    assert ids.tolist() == [[7, 2, 9], [4, 4, 4]]
    assert torch.allclose(logp, torch.tensor([[-0.5, -1.0, 0.0], [-0.1, -0.2, -0.3]]))
    with pytest.raises(ValueError, match="row 0"):
        response_tensors([([1, 2, 3, 4], [0.0] * 4)], 3, pad_id=0)
