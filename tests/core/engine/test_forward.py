"""nereus_core/engine/forward.py's padding rules (the layouts themselves run in tests/tasks)."""

from __future__ import annotations

import pytest
import torch

from nereus_core.engine.forward import padding, position_ids, rows


def test_positions_count_from_each_rows_first_real_token() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])
    positions = position_ids(mask)
    assert positions.tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 1, 1]]
    # transformers' generate: cumsum - 1, pads set to 1; equal wherever the token is real.
    hf = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert torch.equal(positions[mask == 1], hf[mask == 1])


def test_padding_without_pads_is_the_plain_causal_path() -> None:
    for mask in (None, torch.ones(2, 5, dtype=torch.long)):
        positions, kept = padding(mask, 5, torch.device("cpu"))
        assert positions.tolist() == [0, 1, 2, 3, 4] and kept is None
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    positions, kept = padding(mask, 3, torch.device("cpu"))
    assert positions.tolist() == [[0, 0, 1], [0, 1, 2]] and torch.equal(kept, mask)
    assert rows(positions, kept, slice(1, 2))["positions"].tolist() == [[0, 1, 2]]
    shared = rows(torch.arange(3), None, slice(1, 2))
    assert shared["positions"].tolist() == [0, 1, 2] and shared["attention_mask"] is None
    with pytest.raises(ValueError, match="4 columns; the ids have 3"):
        padding(torch.tensor([[0, 1, 1, 1]]), 3, torch.device("cpu"))
