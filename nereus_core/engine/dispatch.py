"""Driver-side bookkeeping: split a global batch over a layout's devices, stitch results back.

Pure functions over tensors and layouts; the device pool (tasks/) does the
sending. Replica ``d`` gets rows ``d*b/dp .. (d+1)*b/dp`` of the batch, or for a pass over
sequences of unequal lengths as many rows as every other replica with the real tokens balanced
(``balanced_rows``); every device of that replica gets the same rows (the first stage reads the
ids, the last stage the targets).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import torch

from nereus_core.config import ModelConfig
from nereus_core.layout import Layout
from nereus_core.model.weights import unshard


def replica_rows(layout: Layout, batch: int) -> list[slice]:
    """The rows of a global batch each replica gets: contiguous blocks, replica by replica."""
    if batch % layout.dp:
        raise ValueError(f"batch {batch} is not divisible by dp={layout.dp}; use a multiple of it")
    size = batch // layout.dp
    return [slice(d * size, (d + 1) * size) for d in range(layout.dp)]


Rows = Sequence[slice | torch.Tensor]  # each replica's rows: a block, or indices in batch order


def balanced_rows(layout: Layout, tokens_b: torch.Tensor) -> Rows:
    """Each replica's rows for a pass over sequences of ``tokens_b`` real tokens: as many rows each,
    the longest row first to the replica holding the fewest tokens so far (ties: the lower replica),
    so the slowest replica of a pass holds about the mean (verl's ``trainer.balance_batch``, on by
    default there, balances its data-parallel ranks alike). A replica's rows keep batch order. Rows
    of one length, or one replica, give ``replica_rows``' blocks."""
    batch = tokens_b.shape[0]
    blocks = replica_rows(layout, batch)
    if layout.dp == 1 or bool((tokens_b == tokens_b[0]).all()):
        return blocks
    size = batch // layout.dp
    order = sorted(range(batch), key=lambda i: (-int(tokens_b[i]), i))
    open_ = [(0, d) for d in range(layout.dp)]  # (tokens so far, replica) of replicas with room
    taken: list[list[int]] = [[] for _ in range(layout.dp)]
    for i in order:
        held, d = heapq.heappop(open_)
        taken[d].append(i)
        if len(taken[d]) < size:
            heapq.heappush(open_, (held + int(tokens_b[i]), d))
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in taken]


def per_device(layout: Layout, tensor: torch.Tensor, rows: Rows | None = None) -> list[torch.Tensor]:
    """One argument per device of ``layout`` (in ``layout.devices`` order): its replica's rows
    (``rows``; default ``replica_rows``)."""
    rows = replica_rows(layout, tensor.shape[0]) if rows is None else rows
    return [tensor[rows[layout.coord(i).dp]].clone() for i in range(layout.world_size)]


def per_device_args(
    layout: Layout, *tensors: torch.Tensor | None, rows: Rows | None = None
) -> list[tuple[torch.Tensor | None, ...]]:
    """One tuple of positional arguments per device: each tensor's replica rows (None stays None)."""
    parts = [per_device(layout, t, rows) if t is not None else [None] * layout.world_size for t in tensors]
    return [tuple(p[i] for p in parts) for i in range(layout.world_size)]


def per_device_batch(
    layout: Layout, batch: Mapping[str, torch.Tensor], rows: Rows | None = None
) -> list[dict[str, torch.Tensor]]:
    """``per_device`` for a dict of per-sequence tensors."""
    parts = {k: per_device(layout, v, rows) for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(layout.world_size)]


def collect(layout: Layout, results: Sequence[torch.Tensor | None], rows: Rows | None = None) -> torch.Tensor:
    """What each replica's returning device (last stage, tp 0) gave, in batch order: concatenated in
    dp order, then put back in place when ``rows`` are not ``replica_rows``' blocks."""
    out = []
    for d in range(layout.dp):
        index = layout.devices.index(layout.device(d, layout.pp - 1, 0))
        value = results[index]
        if value is None:
            raise RuntimeError(f"replica {d} returned nothing from device {layout.devices[index]}")
        out.append(value)
    stacked = torch.cat(out)
    if rows is None or all(isinstance(r, slice) for r in rows):
        return stacked
    placed = torch.empty_like(stacked)
    placed[torch.cat([torch.arange(r.start, r.stop) if isinstance(r, slice) else r for r in rows])] = stacked
    return placed


def assemble_full_state(
    layout: Layout, config: ModelConfig, shards: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Full HF-named parameters from replica 0's per-device slices (``shards`` in layout order)."""
    by_name: dict[str, list[torch.Tensor]] = {}
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            index = layout.devices.index(layout.device(0, pp, tp))
            for name, tensor in shards[index].items():
                by_name.setdefault(name, []).append(tensor)
    full = {name: unshard(name, parts) for name, parts in by_name.items()}
    if config.tie_word_embeddings:
        full.pop("lm_head.weight", None)
    return full
