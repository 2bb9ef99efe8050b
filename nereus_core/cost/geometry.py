"""Model counts and layout geometry the cost model's formulas read: sizes of the busiest pipeline
stage and the links each parallel axis of a layout uses, for one layout or an array of candidates.

Boundary: numbers derived from a ``ModelConfig``, a ``HardwareProfile`` and layouts; no latency or
memory formula (those are ``cost.terms``).

Bytes per value (``value_bytes``): an fp32 model (the default) is counted at the profile's sizes,
which describe the stack the profile stands for (the CPU runtime: fp32; the H100 profile: the bf16
mixed precision of the GPU stack the simulator models). A lower-precision ``model.dtype`` (bf16) is
counted at its own sizes, as the EMU's shard maps size it (``emu.shard_map``): weights, gradients,
activations and KV cache at the parameters' itemsize, and per parameter the fp32 master weights and
AdamW moments the train stage partitions over dp (DeepSpeed's bf16 ZeRO mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from nereus_core.config import ModelConfig
from nereus_core.cost.hardware import HardwareProfile
from nereus_core.emu import MASTER, OPTIMIZER_BYTES, partitioned_kinds
from nereus_core.layout import Layout, stage_layer_counts
from nereus_core.model.weights import head_layers, param_dtype, param_shapes

Num = np.ndarray | float  # a scalar, or one value per candidate layout


@dataclass(frozen=True)
class ValueBytes:
    """Bytes per value of a model-stage's tensors; ``optimizer`` is per parameter (ZeRO shards it over dp)."""

    weight: int
    grad: int
    optimizer: int
    activation: int
    kv: int


@dataclass(frozen=True)
class ModelStats:
    """Counts derived once from a ``ModelConfig``."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the MLP's width
    logit_width: int  # vocab for an lm head, 1 for a value head
    layer_params: int
    embed_params: int
    head_params: int  # lm_head (or the tied embedding's reuse) / value head
    head_layers: float  # the head's compute in decoder layers (``weights.head_layers``; the split's input)
    norm_params: int
    total_params: int
    precision: ValueBytes | None = None  # the model's own sizes; None: fp32, the profile's sizes
    recompute: bool = False  # train passes recompute every decoder layer (``gradient_checkpointing``)

    @property
    def flop_params(self) -> int:
        """Parameters in matmuls (the 2*params rule; the embedding lookup is not a matmul)."""
        return self.layers * self.layer_params + self.head_params

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        """2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


@lru_cache(maxsize=64)
def model_stats(model: ModelConfig) -> ModelStats:
    shapes = param_shapes(model)
    numel = {name: math.prod(shape) for name, shape in shapes.items()}
    per_layer = sum(v for k, v in numel.items() if k.startswith("model.layers.0."))
    value_head = getattr(model, "head", "lm") == "value"
    head = model.hidden_size if value_head else model.vocab_size * model.hidden_size
    return ModelStats(
        layers=model.num_hidden_layers,
        hidden=model.hidden_size,
        heads=model.num_attention_heads,
        kv_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        intermediate=model.intermediate_size,
        logit_width=1 if value_head else model.vocab_size,
        layer_params=per_layer,
        embed_params=model.vocab_size * model.hidden_size,
        head_params=head,
        head_layers=head_layers(model),
        norm_params=model.hidden_size * (2 * model.num_hidden_layers + 1),
        total_params=sum(numel.values()),
        precision=_model_precision(model),
        recompute=bool(getattr(model, "gradient_checkpointing", False)),
    )


def _model_precision(model: ModelConfig) -> ValueBytes | None:
    """A lower-precision model's sizes, taken from the shard map's owners (see the module docstring)."""
    kinds = partitioned_kinds(model)
    if MASTER not in kinds:
        return None
    size = param_dtype(model).itemsize
    return ValueBytes(size, size, OPTIMIZER_BYTES * len(kinds), size, size)


def value_bytes(stats: ModelStats, profile: HardwareProfile) -> ValueBytes:
    """Bytes per value the cost model counts for a model on a profile (see the module docstring)."""
    if stats.precision is not None:
        return stats.precision
    p = profile
    return ValueBytes(p.weight_bytes, p.grad_bytes, p.optimizer_bytes, p.activation_bytes, p.kv_bytes)


@lru_cache(maxsize=4096)
def pipeline_split(stats: ModelStats, pp: int, tp: int) -> tuple[int, int, float]:
    """(layers, matmul params, weight params per device) of the busiest pipeline stage.

    The layers per stage are the runtime's (``Layout.stage_layers``); the first stage holds the
    embedding, the last the final norm and head. Norms are replicated under TP.
    """
    counts = stage_layer_counts(stats.layers, pp, stats.head_layers)
    norm_layer = 2 * stats.hidden
    tied = stats.total_params < stats.layers * stats.layer_params + stats.embed_params + stats.head_params
    best = (0, 0, 0.0)
    for rank in range(pp):
        n = counts[rank]
        flops = n * stats.layer_params + (stats.head_params if rank == pp - 1 else 0)
        sharded = n * (stats.layer_params - norm_layer)
        replicated = n * norm_layer
        if rank == 0:
            sharded += stats.embed_params
        if rank == pp - 1:
            replicated += stats.hidden
            if stats.logit_width == 1:
                replicated += stats.head_params
            elif not tied:
                sharded += stats.head_params
        weights = sharded / tp + replicated
        best = (max(best[0], n), max(best[1], flops), max(best[2], weights))
    return best


class Geometry(NamedTuple):
    """Candidate layouts as arrays (one entry each): degrees, busiest-stage sizes, links."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    m: np.ndarray
    stage_layers: np.ndarray
    stage_flop_params: np.ndarray
    device_params: np.ndarray
    tp_bw: np.ndarray
    pp_bw: np.ndarray
    dp_bw: np.ndarray
    per_node: np.ndarray  # slots of the layout on its busiest node
    f1b: np.ndarray  # a train pipeline runs 1F1B (``Layout.schedule``), else GPipe
    rc: np.ndarray  # a train pass recomputes every layer (``Layout.recompute`` or the model's flag)
    z3: np.ndarray  # a train stage shards weights, gradients and optimizer over dp (``Layout.shard`` full)


@lru_cache(maxsize=4096)
def _end_layers(layers: int, pp: int, head_layers: float) -> tuple[int, int]:
    counts = stage_layer_counts(layers, pp, head_layers)
    return max(counts[:-1], default=0), counts[-1]


def end_stage_layers(stats: ModelStats, pp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate: the most decoder layers a stage before the last holds (0 without a pipeline), and
    the last stage's (which also holds the head), as the runtime splits them."""
    keys, inverse = np.unique(np.asarray(pp, dtype=np.int64), return_inverse=True)
    rows = np.array([_end_layers(stats.layers, int(k), stats.head_layers) for k in keys], dtype=float)
    rows = rows[inverse.reshape(-1)]
    return rows[:, 0], rows[:, 1]


def split_arrays(stats: ModelStats, tp: np.ndarray, pp: np.ndarray) -> tuple[np.ndarray, ...]:
    keys, inverse = np.unique(pp * 65536 + tp, return_inverse=True)
    rows = np.array([pipeline_split(stats, int(k // 65536), int(k % 65536)) for k in keys], dtype=float)
    rows = rows[inverse.reshape(-1)]
    return rows[:, 0], rows[:, 1], rows[:, 2]


def _within(first: np.ndarray, block: np.ndarray, count: np.ndarray, per_node: int) -> np.ndarray:
    """Whether every one of ``count`` contiguous blocks of ``block`` slots from ``first`` is inside a node."""
    offset = first % per_node
    return (offset + block * count <= per_node) | ((first % block == 0) & (per_node % block == 0))


def contiguous_geometry(
    stats: ModelStats,
    profile: HardwareProfile,
    tp: Num,
    pp: Num,
    dp: Num,
    m: Num,
    first: int = 0,
    split: tuple[np.ndarray, ...] | None = None,
    f1b: np.ndarray | None = None,
    rc: np.ndarray | None = None,
    z3: np.ndarray | None = None,
) -> Geometry:
    """Geometry of layouts on consecutive slots from ``first`` (how the controller places them);
    ``split`` is ``pipeline_split`` over the candidates when the caller already has it; ``f1b``
    marks the candidates whose pipelines run 1F1B, ``rc`` those that recompute (the model's launch
    flag when not given), ``z3`` those sharded ``full``."""
    tp, pp, dp, m = (np.atleast_1d(np.asarray(x, dtype=np.int64)) for x in (tp, pp, dp, m))
    first_a = np.full_like(tp, first)
    world = tp * pp * dp
    dpn = profile.devices_per_node
    tp_in = _within(first_a, tp, pp * dp, dpn)
    pp_in = _within(first_a, tp * pp, dp, dpn)
    dp_in = _within(first_a, world, np.ones_like(world), dpn)
    layers, flops, weights = split if split is not None else split_arrays(stats, tp, pp)
    per_node = np.minimum(world, dpn - first % dpn)
    recompute = np.full_like(tp, stats.recompute, dtype=bool)
    if rc is not None:
        recompute |= np.asarray(rc, dtype=bool)
    bw = {True: profile.intra_bw, False: profile.inter_bw}
    return Geometry(
        tp, pp, dp, m, layers, flops, weights,
        np.where(tp_in, bw[True], bw[False]),
        np.where(pp_in, bw[True], bw[False]),
        np.where(dp_in, bw[True], bw[False]),
        per_node.astype(float),
        np.zeros_like(tp, dtype=bool) if f1b is None else np.asarray(f1b, dtype=bool),
        recompute,
        np.zeros_like(tp, dtype=bool) if z3 is None else np.asarray(z3, dtype=bool),
    )  # fmt: skip


def is_contiguous(layout: Layout) -> bool:
    """Whether the layout's slots are ``first, first + 1, ...`` in order."""
    first = layout.devices[0]
    return layout.devices == tuple(range(first, first + len(layout.devices)))


def slots(layout: Layout) -> np.ndarray:
    """The layout's slots as an array (an arange when consecutive: converting 1,024 ints is slow)."""
    if is_contiguous(layout):
        return np.arange(layout.devices[0], layout.devices[0] + len(layout.devices))
    return np.fromiter(layout.devices, dtype=np.int64, count=len(layout.devices))


def layout_geometry(stats: ModelStats, profile: HardwareProfile, layout: Layout) -> Geometry:
    """Geometry of one concrete layout: links from the nodes its groups actually span."""
    nodes = (slots(layout) // profile.devices_per_node).reshape(layout.dp, layout.pp, layout.tp)

    def bw(axis: int) -> float:
        spans = bool((nodes.max(axis=axis) != nodes.min(axis=axis)).any())
        return profile.inter_bw if spans else profile.intra_bw

    per_node = int(np.bincount(nodes.ravel()).max())
    layers, flops, weights = pipeline_split(stats, layout.pp, layout.tp)

    def one(x: float) -> np.ndarray:
        return np.array([x], dtype=float)

    return Geometry(
        one(layout.tp), one(layout.pp), one(layout.dp), one(layout.micro_batches),
        one(layers), one(flops), one(weights), one(bw(2)), one(bw(1)), one(bw(0)),
        one(per_node), np.array([layout.schedule == "1f1b"]), np.array([layout.recompute or stats.recompute]),
        np.array([layout.shard == "full"]),
    )  # fmt: skip
