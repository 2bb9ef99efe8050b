"""Token packing: a padded batch's real tokens as one row per micro-batch, and the way back.

The engine's boundary stays padded (``forward``: prompts left-padded, responses right-padded, an
``attention_mask`` ``[b, s]``); inside, a packed micro-batch runs only its rows' real tokens,
concatenated into ids ``[1, T]`` with positions restarting at 0 per sequence and flash-attn's
``cu_seqlens`` (int32 ``[n+1]``) marking where each sequence starts, so attention stays within a
sequence (``llama`` attends block-diagonal causal). This is verl's ``use_remove_padding`` and
OpenRLHF's ``packing_samples``; their outputs are scattered back to the padded columns.

Micro-batches are contiguous row slices derived from the mask alone, so every pipeline stage and
tp rank of a replica derives the same ones: without a token budget the layout's ``micro_batches``
equal slices (the padded path's), with one (verl's ``ppo_max_token_len_per_gpu``) rows taken
greedily in batch order while they fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    """One packed micro-batch: rows ``rows`` of a padded batch ``[b, width]``."""

    rows: slice
    width: int
    ids: torch.Tensor  # [1, T]: the rows' real tokens, row after row
    positions: torch.Tensor  # [1, T]: each token's position in its sequence
    cu_seqlens: torch.Tensor  # int32 [n+1]: sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    token_index: torch.Tensor  # [T]: each token's flat index in the rows' padded [n, width]
    target_src: torch.Tensor  # packed prediction columns (of T-1) whose next token is in the same row
    target_dst: torch.Tensor  # their flat index in the rows' padded [n, width-1]

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[1])

    @property
    def row_count(self) -> int:
        return self.rows.stop - self.rows.start


def worth_packing(attention_mask_bs: torch.Tensor | None, max_tokens: int | None) -> bool:
    """Whether packing changes what a pass computes: only a batch with padding, or one cut by a token
    budget. A batch without padding runs the padded path, which then is the same computation in one
    batched call (no gather, no scatter)."""
    return max_tokens is not None or (attention_mask_bs is not None and not bool(attention_mask_bs.all()))


def real_lengths(attention_mask_bs: torch.Tensor) -> torch.Tensor:
    """Real tokens per row ``[b]``; refuses a row whose real tokens are not contiguous."""
    real = attention_mask_bs.bool()
    lengths = real.sum(1)
    start = real.int().argmax(1)
    cols = torch.arange(real.shape[1], device=real.device)
    expected = (cols >= start[:, None]) & (cols < (start + lengths)[:, None])
    if not torch.equal(expected, real):
        bad = int((expected != real).any(1).nonzero()[0])
        raise ValueError(
            f"row {bad} of the attention_mask has a gap: packing needs each row's real tokens "
            "contiguous (left-padded prompts, right-padded responses)"
        )
    return lengths


def split_rows(lengths: list[int], *, micro_batches: int, max_tokens: int | None) -> list[slice]:
    """Contiguous row slices: ``micro_batches`` equal ones without a budget, else greedy in batch
    order with at most ``max_tokens`` real tokens each."""
    if max_tokens is None:
        if len(lengths) % micro_batches:
            raise ValueError(
                f"replica batch {len(lengths)} is not divisible by micro_batches={micro_batches}"
            )
        size = len(lengths) // micro_batches
        return [slice(i * size, (i + 1) * size) for i in range(micro_batches)]
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise ValueError(
            f"a row has {longest} real tokens, more than max_tokens={max_tokens} per micro-batch; "
            f"raise max_tokens to at least {longest} or shorten the sequences"
        )
    slices, start, used = [], 0, 0
    for row, length in enumerate(lengths):
        if row > start and used + length > max_tokens:
            slices.append(slice(start, row))
            start, used = row, 0
        used += length
    if lengths:
        slices.append(slice(start, len(lengths)))
    return slices


def split_further(slices: list[slice], count: int) -> list[slice]:
    """``slices`` cut into ``count`` by halving the widest slice (first if tied) until there are
    enough: every data-parallel replica must run as many micro-batches as the others."""
    slices = list(slices)
    while len(slices) < count:
        widest = max(range(len(slices)), key=lambda i: slices[i].stop - slices[i].start)
        cut = slices[widest]
        if cut.stop - cut.start < 2:
            rows = slices[-1].stop - slices[0].start
            raise ValueError(
                f"{rows} rows cannot make {count} micro-batches (another data-parallel replica needs "
                "that many); raise max_tokens or give each replica more rows"
            )
        mid = (cut.start + cut.stop) // 2
        slices[widest : widest + 1] = [slice(cut.start, mid), slice(mid, cut.stop)]
    return slices


def pack(ids_bs: torch.Tensor, attention_mask_bs: torch.Tensor, rows: slice) -> Packed:
    """Rows ``rows`` of a padded batch as one packed row."""
    real = attention_mask_bs[rows].bool()
    width = real.shape[1]
    lengths = real.sum(1)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=real.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    token_index = real.flatten().nonzero().squeeze(1)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    positions = torch.arange(len(token_index), device=real.device) - starts
    # Column t predicts token t+1: kept where t is not its sequence's last token.
    ends = torch.zeros(len(token_index), dtype=torch.bool, device=real.device)
    ends[(cu_seqlens[1:].long() - 1)[lengths > 0]] = True
    target_src = (~ends[:-1]).nonzero().squeeze(1)
    src_index = token_index[target_src]
    target_dst = (src_index // width) * (width - 1) + src_index % width
    return Packed(
        rows=rows,
        width=width,
        ids=ids_bs[rows].flatten()[token_index].unsqueeze(0),
        positions=positions.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        token_index=token_index,
        target_src=target_src,
        target_dst=target_dst,
    )


def micro_batches(
    ids_bs: torch.Tensor,
    attention_mask_bs: torch.Tensor | None,
    *,
    micro_batches: int,
    max_tokens: int | None = None,
    count: int | None = None,
) -> list[Packed]:
    """The packed micro-batches of a padded batch (no mask: every token is real); ``count`` asks
    for at least that many (``split_further``)."""
    mask = torch.ones_like(ids_bs) if attention_mask_bs is None else attention_mask_bs.to(ids_bs.device)
    lengths = real_lengths(mask).tolist()
    slices = split_rows(lengths, micro_batches=micro_batches, max_tokens=max_tokens)
    if count is not None:
        slices = split_further(slices, count)
    return [pack(ids_bs, mask, rows) for rows in slices]


def unpack_tokens(packed: Packed, out_1t: torch.Tensor) -> torch.Tensor:
    """Per-token outputs ``[1, T]`` (values) -> ``[rows, width]``, 0 at pads."""
    flat = out_1t.new_zeros(packed.row_count * packed.width)
    return flat.index_copy(0, packed.token_index, out_1t[0]).view(packed.row_count, packed.width)


def unpack_targets(packed: Packed, out_1t: torch.Tensor) -> torch.Tensor:
    """Next-token outputs ``[1, T-1]`` (column t about token t+1: log-probs, entropies) ->
    ``[rows, width-1]``; 0 wherever t or t+1 is not a real token of the same row."""
    flat = out_1t.new_zeros(packed.row_count * (packed.width - 1))
    values = out_1t[0].index_select(0, packed.target_src)
    return flat.index_copy(0, packed.target_dst, values).view(packed.row_count, packed.width - 1)
