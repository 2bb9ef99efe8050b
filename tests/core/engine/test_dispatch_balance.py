"""How a pass's batch is split over a layout's replicas (``engine.dispatch``): each replica gets as
many rows, their real tokens balanced, and the results come back in batch order."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_core.engine import dispatch
from nereus_core.layout import Layout


def layout(tp: int, pp: int, dp: int) -> Layout:
    return Layout(tp=tp, pp=pp, dp=dp, devices=tuple(range(tp * pp * dp)))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.data())
def test_rows_are_a_partition_of_equal_parts_with_balanced_tokens(
    dp: int, per: int, data: st.DataObject
) -> None:
    tokens = torch.tensor(data.draw(st.lists(st.integers(1, 500), min_size=dp * per, max_size=dp * per)))
    rows = dispatch.balanced_rows(layout(1, 1, dp), tokens)
    index = [torch.arange(r.start, r.stop) if isinstance(r, slice) else r for r in rows]
    assert sorted(torch.cat(index).tolist()) == list(range(dp * per))
    assert all(len(r) == per for r in index) and all(bool((r[1:] > r[:-1]).all()) for r in index)
    held = [int(tokens[r].sum()) for r in index]
    # Longest-first to the lightest replica: the heaviest is within one row of the mean.
    assert max(held) <= tokens.sum().item() / dp + tokens.max().item()


def test_a_skewed_batch_is_evened_out_and_equal_rows_keep_their_blocks() -> None:
    tokens = torch.tensor(
        [90, 80, 70, 60, 10, 9, 8, 7]
    )  # the long rows first, as a contiguous split would lose
    rows = dispatch.balanced_rows(layout(1, 1, 2), tokens)
    assert [r.tolist() for r in rows] == [[0, 3, 4, 7], [1, 2, 5, 6]]
    assert [int(tokens[r].sum()) for r in rows] == [167, 167]
    same = dispatch.balanced_rows(layout(1, 1, 2), torch.full((8,), 5))
    assert same == dispatch.replica_rows(layout(1, 1, 2), 8)


def test_results_come_back_in_batch_order_from_every_replica() -> None:
    lay = layout(2, 2, 3)
    tokens = torch.tensor([7, 1, 9, 3, 3, 8, 2, 6, 5])
    batch = torch.arange(9 * 4).reshape(9, 4)
    rows = dispatch.balanced_rows(lay, tokens)
    parts = dispatch.per_device(lay, batch, rows)
    # Only the last stage's tp-0 device of each replica returns, as the forward pass does.
    returned = [parts[i] * 10 if lay.coord(i).pp == 1 and lay.coord(i).tp == 0 else None for i in range(12)]
    assert torch.equal(dispatch.collect(lay, returned, rows), batch * 10)
    assert any(not isinstance(r, slice) and r.tolist() != list(range(r[0], r[0] + 3)) for r in rows)
