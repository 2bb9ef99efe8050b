"""Packing a padded batch (engine.packing): the packed row holds each row's real tokens with
positions and cu_seqlens as transformers and flash-attn expect, the outputs come back to the padded
columns, and micro-batches follow the layout's equal slices or a token budget."""

from __future__ import annotations

import pytest
import torch

from nereus_core.engine import packing
from nereus_core.engine.forward import position_ids
from nereus_core.model.llama import LlamaStage
from nereus_core.model.weights import init_full_state
from tests.support.model_configs import TWO_HEADS

LEFT_PADS, REAL = (0, 3, 1, 6), (12, 6, 10, 2)  # prompt pads and real tokens of each row of 12


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    cols = torch.arange(12)
    start = torch.tensor(LEFT_PADS)[:, None]
    mask = ((cols >= start) & (cols < start + torch.tensor(REAL)[:, None])).long()
    ids = torch.randint(1, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    return ids.masked_fill(mask == 0, 0), mask


def test_pack_holds_real_tokens_with_positions_and_cu_seqlens() -> None:
    ids, mask = _batch()
    packed = packing.pack(ids, mask, slice(0, 4))
    real = mask.bool()
    assert torch.equal(packed.ids[0], ids[real])
    assert torch.equal(packed.positions[0], position_ids(mask)[real])
    assert packed.cu_seqlens.dtype is torch.int32
    assert packed.cu_seqlens.tolist() == [0, 12, 18, 28, 30]


def test_unpack_round_trips_values_and_next_token_outputs() -> None:
    ids, mask = _batch()
    packed = packing.pack(ids, mask, slice(1, 4))
    values = packing.unpack_tokens(packed, packed.ids.float())
    assert torch.equal(values, (ids[1:4] * mask[1:4]).float())
    # A next-token output of column t names token t+1: it comes back where t and t+1 are real.
    nxt = packing.unpack_targets(packed, packed.ids[:, 1:].float())
    both = (mask[1:4, :-1] * mask[1:4, 1:]).bool()
    assert nxt.shape == (3, 11)
    assert torch.equal(nxt[both], ids[1:4, 1:][both].float())
    assert not nxt[~both].any()


def test_unpack_passes_gradients_to_real_tokens_only() -> None:
    ids, mask = _batch()
    packed = packing.pack(ids, mask, slice(0, 4))
    out = torch.zeros(1, packed.tokens - 1, requires_grad=True)
    packing.unpack_targets(packed, out).sum().backward()
    ends = set((packed.cu_seqlens[1:] - 1).tolist())
    assert out.grad[0].tolist() == [0.0 if t in ends else 1.0 for t in range(packed.tokens - 1)]


def test_equal_slices_without_budget() -> None:
    ids, mask = _batch()
    mbs = packing.micro_batches(ids, mask, micro_batches=2)
    assert [p.rows for p in mbs] == [slice(0, 2), slice(2, 4)]
    assert [p.tokens for p in mbs] == [18, 12]


def test_budget_fills_micro_batches_greedily_in_order() -> None:
    ids, mask = _batch()
    mbs = packing.micro_batches(ids, mask, micro_batches=1, max_tokens=18)
    assert [p.rows for p in mbs] == [slice(0, 2), slice(2, 4)]
    mbs = packing.micro_batches(ids, mask, micro_batches=1, max_tokens=12)
    assert [p.rows for p in mbs] == [slice(0, 1), slice(1, 2), slice(2, 4)]
    assert all(p.tokens <= 12 for p in mbs)
    assert [p.rows for p in packing.micro_batches(ids, mask, micro_batches=1, max_tokens=100)] == [
        slice(0, 4)
    ]


def test_split_further_halves_the_widest_slice() -> None:
    assert packing.split_further([slice(0, 1), slice(1, 5)], 3) == [slice(0, 1), slice(1, 3), slice(3, 5)]
    with pytest.raises(ValueError, match="2 rows cannot make 3 micro-batches"):
        packing.split_further([slice(0, 1), slice(1, 2)], 3)


def test_a_row_over_the_budget_is_refused_naming_both_numbers() -> None:
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"12 real tokens, more than max_tokens=10 .* at least 12"):
        packing.micro_batches(ids, mask, micro_batches=1, max_tokens=10)


def test_a_gap_in_a_row_is_refused() -> None:
    ids, mask = _batch()
    mask[2, 5] = 0
    with pytest.raises(ValueError, match="row 2 of the attention_mask has a gap"):
        packing.micro_batches(ids, mask, micro_batches=1)


def test_no_mask_packs_every_token() -> None:
    ids, _ = _batch()
    (packed,) = packing.micro_batches(ids, None, micro_batches=1)
    assert packed.cu_seqlens.tolist() == [0, 12, 24, 36, 48]
    assert torch.equal(packed.positions[0], torch.arange(12).repeat(4))


def _stage() -> LlamaStage:
    cfg = TWO_HEADS
    stage = LlamaStage(cfg, layers=range(cfg.num_hidden_layers), first=True, last=True)
    stage.load_full_state(init_full_state(cfg))
    return stage


def test_segments_attend_within_each_sequence_only() -> None:
    """A packed row's logits equal each sequence run alone (positions from 0)."""
    stage, gen = _stage(), torch.Generator().manual_seed(1)
    # Runs of one length attend in one batched call; lengths also repeat apart.
    lengths = (5, 5, 1, 9, 9, 9, 5, 1, 1)
    seqs = [torch.randint(0, TWO_HEADS.vocab_size, (1, n), generator=gen) for n in lengths]
    ids = torch.cat(seqs, dim=1)
    positions = torch.cat([torch.arange(s.shape[1]) for s in seqs])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        packed = stage(ids, positions, segments=cu)
        alone = torch.cat([stage(s, torch.arange(s.shape[1])) for s in seqs], dim=1)
        unsegmented = stage(ids, positions)
    assert (packed - alone).abs().max().item() <= 1e-5
    assert (unsegmented - alone).abs().max().item() > 1e-3  # without segments the sequences mix


def test_last_only_is_the_last_column_of_the_full_head() -> None:
    stage = _stage()
    ids = torch.randint(0, TWO_HEADS.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = stage(ids, torch.arange(7))
        last = stage(ids, torch.arange(7), last_only=True)
    assert last.shape == (2, 1, full.shape[-1])
    assert (last - full[:, -1:]).abs().max().item() <= 1e-6  # one matmul row vs many: rounding only


def test_only_padding_or_a_budget_is_worth_packing() -> None:
    full = torch.ones(3, 5, dtype=torch.long)
    padded = full.clone()
    padded[1, -2:] = 0
    assert not packing.worth_packing(None, None)
    assert not packing.worth_packing(full, None)  # nothing to remove: the padded path's one call
    assert packing.worth_packing(padded, None)
    assert packing.worth_packing(full, 64)  # a budget cuts micro-batches by tokens
