"""Elastic Model Units: where every tensor of a model-stage lives under a layout, and how to move it.

An EMU is the state of one data-parallel replica of a model-stage. A *shard map*
describes all of a layout's EMUs at once: for every tensor (parameters by Hugging Face name;
for train stages also the AdamW moments ``<param>:exp_avg`` / ``<param>:exp_avg_sq``, the fp32
master weights ``<param>:master`` when the parameters are of lower precision, and the step
count ``optimizer:step``) its global shape, the dim split under TP, the pipeline stage
holding it, and the boxes (per-dim ``[start, stop)``) each device holds. ``plan_reshard``
turns two shard maps into the slice transfers that carry the old placement to the new one.

Boundary: bookkeeping over shapes only. No tensor data, processes or files: the executor
(tasks/) moves the bytes as planned and the store (storage/) persists the same boxes.

Optimizer state (ZeRO over dp). The moments of a parameter on a (tp, pp) rank split that rank's
parameter shard over the dp ranks by ``nereus_core.box``' rule for the layout's ``shard``:
Nereus's canonical ZeRO-1 share (``optimizer``) or DeepSpeed's ZeRO-3 partition (``full``). Under
``full`` the parameters split the same way: an EMU is then not a whole replica but the dp
rank's share of every tensor, and a layout's EMUs together hold each tensor once. The step count
(one element) is replicated on every device of a train layout.

Mixed precision (``model.dtype: bf16``): DeepSpeed keeps an fp32 copy of each rank's ZeRO
partition of the weights (the master weights; the bf16 parameters are it, rounded). It is
state of its own, partitioned like the moments: rebuilding it from the bf16 weights would lose
the low bits every step adds to it. Parameters take the model's dtype; the rest is fp32.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from nereus_core.box import Box, share_boxes
from nereus_core.config import ModelConfig
from nereus_core.layout import Coord, Layout
from nereus_core.model.weights import param_dtype, param_shapes, shard_dim, stage_layers, stage_param_names

Kind = Literal["param", "master", "exp_avg", "exp_avg_sq", "step"]
MOMENTS: tuple[Kind, ...] = ("exp_avg", "exp_avg_sq")
MASTER: Kind = "master"
OPTIMIZER_BYTES = 4  # masters, moments and the step count are fp32 whatever the model's dtype
# ZeRO-1/2's gradient reduction bucket (DeepSpeed's ``reduce_bucket_size`` default), in fp32 elements.
REDUCE_BUCKET_ELEMENTS = 500_000_000
STEP = "optimizer:step"
MEMORY_KINDS = ("params", "grads", "optimizer")


def reduce_bucket_elements(params: int) -> int:
    """The ZeRO gradient bucket of a train stage of ``params`` elements on a device: DeepSpeed's default,
    never more than the gradients it holds. ZeRO-1/2 allocate the whole bucket (fp32) at every
    micro-batch's backward, so at the default a small stage would take 2 GB a step for it."""
    return max(1, min(REDUCE_BUCKET_ELEMENTS, int(params)))


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """Where a local tensor sits in its global tensor: the global shape and the box it covers."""

    global_shape: tuple[int, ...]
    box: Box


class Piece(NamedTuple):
    """One box of one tensor held by one device; ``offset``: its start in the device's flat buffer."""

    device: int
    coord: Coord
    box: Box
    offset: int = 0


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a model-stage: shape, TP split dim, pipeline stage and every piece (rank order)."""

    name: str
    param: str
    kind: Kind
    shape: tuple[int, ...]
    split_dim: int | None
    pp_rank: int | None  # None: held on every stage (the step count)
    itemsize: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def slice_spec(self, piece: Piece) -> SliceSpec:
        return SliceSpec(self.shape, piece.box)


@dataclass(frozen=True)
class ShardMap:
    """Every tensor of one model-stage under one layout, in a fixed order (params in HF order first).

    A function of its ``recipe`` (``shard_map``'s arguments): equal recipes, equal maps; it pickles
    as its recipe (a few hundred bytes to a device, which builds it once)."""

    config: ModelConfig
    layout: Layout
    train: bool
    tensors: tuple[TensorSpec, ...] = field(compare=False)  # a function of the other fields
    dtype_bytes: int | None = None
    _index: dict[str, TensorSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {t.name: t for t in self.tensors})

    @property
    def recipe(self) -> tuple[ModelConfig, Layout, bool, int | None]:
        return (self.config, self.layout, self.train, self.dtype_bytes)

    def __reduce__(self) -> tuple[object, tuple[ModelConfig, Layout, bool, int | None]]:
        return (_shard_map, self.recipe)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def tensor(self, name: str) -> TensorSpec:
        spec = self._index.get(name)
        if spec is None:
            raise KeyError(f"{name!r} is not a tensor of this shard map ({self.layout.key})")
        return spec

    def pieces_on(self, device: int) -> list[tuple[TensorSpec, Piece]]:
        """What ``device`` holds, tensor by tensor, pieces in flat-buffer order."""
        return [(t, p) for t in self.tensors for p in t.pieces if p.device == device]

    def emu(self, dp: int) -> list[tuple[TensorSpec, Piece]]:
        """The pieces held by dp rank ``dp``: its parameters (its share of them when sharded ``full``) and its
        share of the optimizer state."""
        return [(t, p) for t in self.tensors for p in t.pieces if p.coord.dp == dp]

    def wanted(self, device: int) -> list[tuple[str, Box]]:
        """``(name, box)`` of every piece on ``device``: what to ask the store for when rehydrating it."""
        return [(t.name, p.box) for t, p in self.pieces_on(device)]


def state_name(param: str, kind: Kind) -> str:
    """The tensor name of ``kind`` of ``param``: the HF name itself, ``<param>:exp_avg``, ..."""
    if kind == "param":
        return param
    return STEP if kind == "step" else f"{param}:{kind}"


def split_state_name(name: str) -> tuple[str, Kind]:
    """``(param, kind)`` of a tensor name (``('', 'step')`` for the step count)."""
    if name == STEP:
        return "", "step"
    param, sep, kind = name.rpartition(":")
    if not sep:
        return name, "param"
    if kind not in (MASTER, *MOMENTS):
        raise ValueError(f"{name!r}: unknown state kind {kind!r}; expected one of {(MASTER, *MOMENTS)}")
    return param, kind  # type: ignore[return-value]


def partitioned_kinds(config: ModelConfig) -> tuple[Kind, ...]:
    """The kinds a train stage holds in ZeRO-1 partitions: the moments, led by the fp32 master
    weights when the parameters are of lower precision (with fp32 ones they are the weights)."""
    return MOMENTS if config.dtype == "fp32" else (MASTER, *MOMENTS)


def _tp_box(shape: tuple[int, ...], dim: int | None, tp_rank: int, tp: int) -> Box:
    if dim is None or tp == 1:
        return Box.full(shape)
    part = shape[dim] // tp
    start = tuple(tp_rank * part if d == dim else 0 for d in range(len(shape)))
    stop = tuple((tp_rank + 1) * part if d == dim else s for d, s in enumerate(shape))
    return Box(start, stop)


def _dp_pieces(device: int, coord: Coord, shard: Box, layout: Layout) -> list[Piece]:
    """Dp rank ``coord.dp``'s share of one tensor shard under ``layout.shard`` (``box``)."""
    return [
        Piece(device, coord, box, offset)
        for box, offset in share_boxes(layout.shard, shard, layout.dp, coord.dp)
    ]


def _param_stages(config: ModelConfig, layout: Layout) -> dict[str, int]:
    stage_of: dict[str, int] = {}
    for p in range(layout.pp):
        layers = stage_layers(config, layout, p)
        for name in stage_param_names(config, layers, first=p == 0, last=p == layout.pp - 1):
            stage_of[name] = p
    return stage_of


def shard_map(
    config: ModelConfig, layout: Layout, *, train: bool, dtype_bytes: int | None = None
) -> ShardMap:
    """The shard map of a model-stage under ``layout``; ``train`` adds AdamW state (ZeRO-1 over dp).

    Item sizes: the parameters' from ``model.dtype``, fp32 for the optimizer's state;
    ``dtype_bytes`` sets one size for every tensor instead (a uniform estimate). Cached per process."""
    return _shard_map(config, layout, train, dtype_bytes)


@functools.lru_cache(maxsize=32)
def _shard_map(config: ModelConfig, layout: Layout, train: bool, dtype_bytes: int | None) -> ShardMap:
    for problem in (config.tp_error(layout.tp), config.pp_error(layout.pp)):
        if problem:
            raise ValueError(f"layout {layout.key}: {problem}")
    stage_of = _param_stages(config, layout)
    coords = [(device, layout.coord(i)) for i, device in enumerate(layout.devices)]
    params: list[TensorSpec] = []
    moments: list[TensorSpec] = []
    param_bytes = dtype_bytes or param_dtype(config).itemsize
    state_bytes = dtype_bytes or OPTIMIZER_BYTES
    for name, shape in param_shapes(config).items():
        dim, stage = shard_dim(name), stage_of[name]
        held = [(d, c, _tp_box(shape, dim, c.tp, layout.tp)) for d, c in coords if c.pp == stage]
        if layout.shard == "full":
            pieces = tuple(p for d, c, box in held for p in _dp_pieces(d, c, box, layout))
        else:
            pieces = tuple(Piece(d, c, box) for d, c, box in held)
        params.append(TensorSpec(name, name, "param", shape, dim, stage, param_bytes, pieces))
        if train:
            shares = tuple(p for d, c, box in held for p in _dp_pieces(d, c, box, layout))
            for kind in partitioned_kinds(config):
                spec = TensorSpec(state_name(name, kind), name, kind, shape, dim, stage, state_bytes, shares)
                moments.append(spec)
    if train:
        steps = tuple(Piece(d, c, Box((), ())) for d, c in coords)
        moments.append(TensorSpec(STEP, "", "step", (), None, None, state_bytes, steps))
    return ShardMap(config, layout, train, tuple(params + moments), dtype_bytes)


def bytes_per_device(
    model_config: ModelConfig, layout: Layout, *, train: bool, dtype_bytes: int | None = None
) -> dict[int, dict[str, int]]:
    """Bytes of ``params``, ``grads`` (train; in the parameters' dtype, whole under ZeRO-1/2, the dp
    rank's share under ZeRO-3) and ``optimizer`` (moments, masters if any, step count) per device;
    sizes as ``shard_map``'s."""
    smap = shard_map(model_config, layout, train=train, dtype_bytes=dtype_bytes)
    out = {d: dict.fromkeys(MEMORY_KINDS, 0) for d in layout.devices}
    for spec in smap.tensors:
        for piece in spec.pieces:
            nbytes = piece.box.numel * spec.itemsize
            if spec.kind == "param":
                out[piece.device]["params"] += nbytes
                out[piece.device]["grads"] += nbytes if train else 0
            else:
                out[piece.device]["optimizer"] += nbytes
    return out


class Transfer(NamedTuple):
    """Copy ``region`` (global coordinates) of ``name`` from ``src``'s piece to ``dst``'s piece."""

    name: str
    src: int
    dst: int
    src_piece: Piece
    dst_piece: Piece
    region: Box
    nbytes: int

    @property
    def src_slice(self) -> Box:
        """The region in the source piece's local coordinates."""
        return self.region.relative_to(self.src_piece.box)

    @property
    def dst_slice(self) -> Box:
        """The region in the destination piece's local coordinates."""
        return self.region.relative_to(self.dst_piece.box)


@dataclass(frozen=True)
class ReshardPlan:
    """Cross-device ``transfers`` and same-device ``local`` copies that build the new placement;
    a function of its two shard maps (``plan_reshard``), it pickles as them."""

    old_map: ShardMap = field(repr=False)
    new_map: ShardMap = field(repr=False)
    transfers: tuple[Transfer, ...]
    local: tuple[Transfer, ...]
    bytes_moved: int
    bytes_local: int

    def __reduce__(self) -> tuple[object, tuple[ShardMap, ShardMap]]:
        return (plan_reshard, (self.old_map, self.new_map))

    def sent_bytes(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.src] += t.nbytes
        return dict(out)

    def received_bytes(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.dst] += t.nbytes
        return dict(out)


class _Sources:
    """The distinct old boxes of one tensor (a partition of it) with their holders, indexed on dim 0."""

    def __init__(self, spec: TensorSpec) -> None:
        groups: dict[Box, dict[int, Piece]] = {}
        for piece in spec.pieces:
            groups.setdefault(piece.box, {})[piece.device] = piece
        self.boxes = list(groups)
        self.holders = [groups[b] for b in self.boxes]
        if sum(b.numel for b in self.boxes) != math.prod(spec.shape):
            raise ValueError(f"{spec.name}: the old pieces do not partition the tensor; cannot plan")
        self.bounds: list[int] = []
        self.buckets: list[list[int]] = []
        if spec.shape:
            self.bounds = sorted({b.start[0] for b in self.boxes} | {b.stop[0] for b in self.boxes})
            self.buckets = [[] for _ in self.bounds[:-1]]
            for i, b in enumerate(self.boxes):
                for k in range(bisect_left(self.bounds, b.start[0]), bisect_left(self.bounds, b.stop[0])):
                    self.buckets[k].append(i)

    def overlapping(self, box: Box) -> list[tuple[Box, dict[int, Piece]]]:
        """``(region, holders)`` for every old box meeting ``box``, in a fixed order."""
        ids: set[int] = set(range(len(self.boxes)))  # 0-d: the one box
        if box.start:
            lo = max(bisect_right(self.bounds, box.start[0]) - 1, 0)
            hi = bisect_left(self.bounds, box.stop[0])
            ids = {i for k in range(lo, hi) for i in self.buckets[k]}
        out = []
        for i in sorted(ids):
            region = self.boxes[i].intersect(box)
            if region is not None:
                out.append((region, self.holders[i]))
        return out


def _check_compatible(old: ShardMap, new: ShardMap) -> None:
    for spec in new.tensors:
        if spec.name not in old._index:
            raise ValueError(f"{spec.name}: the new layout needs it but the old shard map has none")
        before = old.tensor(spec.name)
        if (before.shape, before.itemsize) != (spec.shape, spec.itemsize):
            raise ValueError(
                f"{spec.name}: shape/itemsize {before.shape}/{before.itemsize} before, "
                f"{spec.shape}/{spec.itemsize} after; a reshard cannot change them"
            )


@functools.lru_cache(maxsize=16)
def plan_reshard(old_map: ShardMap, new_map: ShardMap) -> ReshardPlan:
    """The slice transfers that turn ``old_map``'s placement into ``new_map``'s.

    Every destination piece is cut by the old boxes (interval intersection of N-d boxes).
    A region already on the destination device is a local copy (no bytes over a link);
    otherwise its source is the holder with the fewest bytes sent so far (ties: lowest
    device), which spreads replicated tensors (dp replicas, norms across tp) over their holders.
    Each process keeps the plans it made last: a transition or weight sync that recurs (every
    step's sync, a round trip) is planned once, on the driver and on each device.
    """
    _check_compatible(old_map, new_map)
    sent: dict[int, int] = defaultdict(int)
    transfers: list[Transfer] = []
    local: list[Transfer] = []
    for spec in new_map.tensors:
        sources = _Sources(old_map.tensor(spec.name))
        for piece in spec.pieces:
            for region, holders in sources.overlapping(piece.box):
                nbytes = region.numel * spec.itemsize
                src = piece.device if piece.device in holders else min(holders, key=lambda d: (sent[d], d))
                move = Transfer(spec.name, src, piece.device, holders[src], piece, region, nbytes)
                if src == piece.device:
                    local.append(move)
                else:
                    sent[src] += nbytes
                    transfers.append(move)
    return ReshardPlan(
        old_map=old_map,
        new_map=new_map,
        transfers=tuple(transfers),
        local=tuple(local),
        bytes_moved=sum(t.nbytes for t in transfers),
        bytes_local=sum(t.nbytes for t in local),
    )


def min_bytes(old_map: ShardMap, new_map: ShardMap) -> int:
    """The least cross-device bytes any reshard needs: per destination element, 0 if its device held it.

    Computed device by device (new boxes minus the same device's old boxes, which are disjoint),
    independently of ``plan_reshard``'s source choice, so the two can check each other.
    """
    _check_compatible(old_map, new_map)
    total = 0
    for spec in new_map.tensors:
        old_boxes: dict[int, list[Box]] = defaultdict(list)
        for piece in old_map.tensor(spec.name).pieces:
            old_boxes[piece.device].append(piece.box)
        for piece in spec.pieces:
            present = 0
            for box in old_boxes.get(piece.device, ()):
                inter = box.intersect(piece.box)
                present += inter.numel if inter is not None else 0
            total += (piece.box.numel - present) * spec.itemsize
    return total
