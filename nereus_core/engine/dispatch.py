"""Driver-side bookkeeping: split a global batch over a layout's devices, stitch results back.

Pure functions over tensors and layouts; the device pool (tasks/) does the
sending. Replica ``d`` gets rows ``d*b/dp .. (d+1)*b/dp`` of the batch, and every
device of that replica gets the same rows (the first stage reads the ids, the
last stage the targets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nereus_core.config import ModelConfig
from nereus_core.layout import Layout
from nereus_core.model.weights import unshard


def replica_rows(layout: Layout, batch: int) -> list[slice]:
    """The rows of a global batch each replica gets."""
    if batch % layout.dp:
        raise ValueError(f"batch {batch} is not divisible by dp={layout.dp}; use a multiple of it")
    size = batch // layout.dp
    return [slice(d * size, (d + 1) * size) for d in range(layout.dp)]


def per_device(layout: Layout, tensor: torch.Tensor) -> list[torch.Tensor]:
    """One argument per device of ``layout`` (in ``layout.devices`` order): its replica's rows."""
    rows = replica_rows(layout, tensor.shape[0])
    return [tensor[rows[layout.coord(i).dp]].clone() for i in range(layout.world_size)]


def per_device_args(layout: Layout, *tensors: torch.Tensor | None) -> list[tuple[torch.Tensor | None, ...]]:
    """One tuple of positional arguments per device: each tensor's replica rows (None stays None)."""
    parts = [per_device(layout, t) if t is not None else [None] * layout.world_size for t in tensors]
    return [tuple(p[i] for p in parts) for i in range(layout.world_size)]


def per_device_batch(layout: Layout, batch: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``per_device`` for a dict of per-sequence tensors."""
    parts = {k: per_device(layout, v) for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(layout.world_size)]


def collect(layout: Layout, results: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Concatenate, in dp order, what each replica's returning device (last stage, tp 0) gave."""
    out = []
    for d in range(layout.dp):
        index = layout.devices.index(layout.device(d, layout.pp - 1, 0))
        value = results[index]
        if value is None:
            raise RuntimeError(f"replica {d} returned nothing from device {layout.devices[index]}")
        out.append(value)
    return torch.cat(out)


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
