"""One device's EMU pieces of a model-stage: read out of a ``ModelShard``, put into a new one.

The pieces are those of ``ShardMap.pieces_on(device)`` (nereus_core/emu.py): parameter
shards, the AdamW moments (and, with bf16 parameters, the fp32 master weights) in Nereus's
canonical ZeRO-1 partition, the step count. Keys are
``(tensor name, global box)``; parameters are views of the live weights (no copy).

DeepSpeed's ZeRO-1/2 optimizer (``deepspeed/runtime/zero/stage_1_and_2.py``) keeps, per param
group, one flat buffer of the local parameters (``round_robin_bit16_groups`` at
``round_robin_bit16_offsets``, zero-padded to a multiple of ``2*dp``) cut into ``dp`` equal
partitions; DP group rank ``j`` (ranks sorted by world rank, whatever the layout's order)
owns ``[j*P, (j+1)*P)`` as ``single_partition_of_fp32_groups[i]``, and the base optimizer's
state (``exp_avg``, ``exp_avg_sq``, a 0-d float ``step`` tensor) is keyed by that partition.
Nereus's partition splits each parameter separately instead, so converting needs an exchange
inside the DP group: ``zero1_segments`` cuts every parameter's canonical ranges at DeepSpeed's
partition boundaries, and each segment moves between its two holders (``engine.exchange``);
a share inside its own rank's partition is a view of it instead (no copy). A new shard's
engine is built first (``new_shard``), so weights and own-partition moments are written
straight into its buffers; ``install_state`` then moves the other moments into place and sets
the step count. The fp32 master partition is itself a partitioned piece kind when the weights
are bf16, moved like the moments and installed as read; with fp32 weights it equals them, and
``install_state`` refreshes it from the written weights.

A train stage sharded ``full`` (ZeRO-3) keeps its pieces in its own partitions: ``state_zero3``.

Boundary: one device's tensors and its DP group's exchange; where the pieces come from or go
to (another device, the store) is ``nereus_core.engine.reshard``'s business.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from nereus_core.box import canonical_range
from nereus_core.emu import MASTER, MOMENTS, STEP, Box, Kind, ShardMap, partitioned_kinds
from nereus_core.engine import state_zero3
from nereus_core.engine.device import DeviceContext, RankGroups
from nereus_core.engine.exchange import DEFAULT_TIMEOUT_S, exchange
from nereus_core.engine.optimizer import make_engine
from nereus_core.engine.shard import ModelShard, OptimizerSettings, get_shard, new_stage
from nereus_core.model.llama import LlamaStage

Pieces = state_zero3.Pieces
STEP_BOX = state_zero3.STEP_BOX
# Tags of the DP-group exchanges (the reshard's own exchange uses others).
EXTRACT_TAG = 1 << 20
INSTALL_TAG = 2 << 20


@dataclass
class DeviceState:
    """A device's pieces, and the canonical flat ZeRO-1 share ``(param, kind) -> 1-d`` they view into."""

    pieces: Pieces
    moments: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    @property
    def step(self) -> torch.Tensor | None:
        return self.pieces.get((STEP, STEP_BOX))


class Segment(NamedTuple):
    """Flat range ``[lo, hi)`` of parameter ``param``: in ZeRO partition ``part``, canonical rank ``dp``."""

    param: int
    part: int
    dp: int
    lo: int
    hi: int


def zero1_segments(numels: list[int], offsets: list[int], partition_size: int, dp: int) -> list[Segment]:
    """Every parameter's canonical dp ranges, cut where DeepSpeed's partitions of the flat buffer end."""
    if partition_size * dp < max((o + n for o, n in zip(offsets, numels, strict=True)), default=0):
        raise ValueError(f"{dp} partitions of {partition_size} do not cover the flat buffer")
    out: list[Segment] = []
    for p, (numel, offset) in enumerate(zip(numels, offsets, strict=True)):
        for k in range(dp):
            lo, hi = canonical_range(numel, dp, k)
            while lo < hi:
                part = (offset + lo) // partition_size
                end = min(hi, (part + 1) * partition_size - offset)
                out.append(Segment(p, part, k, lo, end))
                lo = end
    return out


@dataclass
class _Zero1Group:
    """One param group of DeepSpeed's ZeRO-1/2 optimizer as seen from this rank."""

    names: list[str]
    numels: list[int]
    offsets: list[int]
    partition_size: int
    part_ranks: list[int]  # world rank holding partition j
    partition: torch.Tensor  # this rank's fp32 master partition (the base optimizer's param)


def _zero1_groups(shard: ModelShard) -> list[_Zero1Group]:
    opt = shard.engine.optimizer
    if not hasattr(opt, "single_partition_of_fp32_groups"):
        raise NotImplementedError(
            f"{shard.name}: optimizer {type(opt).__name__} is not DeepSpeed's ZeRO-1/2 optimizer; "
            "resharding optimizer state needs zero_stage 1 or 2"
        )
    names = {id(p): n for n, p in shard.stage.named_parameters()}
    out = []
    for i, params in enumerate(opt.round_robin_bit16_groups):
        part_ranks = dist.get_process_group_ranks(opt.real_dp_process_group[i])
        if len(part_ranks) != shard.layout.dp:
            raise RuntimeError(
                f"{shard.name}: ZeRO partitions over {len(part_ranks)} ranks but dp={shard.layout.dp}"
            )
        out.append(
            _Zero1Group(
                names=[names[id(p)] for p in params],
                numels=[p.numel() for p in params],
                offsets=list(opt.round_robin_bit16_offsets[i]),
                partition_size=int(opt.partition_size[i]),
                part_ranks=list(part_ranks),
                partition=opt.single_partition_of_fp32_groups[i],
            )
        )
    return out


def _with_master(
    shard: ModelShard, group: _Zero1Group, flats: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``flats`` plus, when the master weights are a piece kind of their own, ZeRO's fp32 partition
    itself under ``MASTER`` (read and written in place: never rebuilt from the rounded weights)."""
    if MASTER in partitioned_kinds(shard.config):
        return {**flats, MASTER: group.partition.detach()}
    return flats


View = tuple[torch.Tensor | None, torch.Tensor | None, int, int]  # source view, destination view, src, dst


def _moment_views(
    rank: int,
    group: _Zero1Group,
    groups: RankGroups,
    flats: dict[str, torch.Tensor],
    moments: dict[tuple[str, str], torch.Tensor],
    *,
    kinds: tuple[Kind, ...],
    to_canonical: bool,
) -> list[View]:
    """Every segment of ``group`` that touches ``rank``, as views of the partition and canonical buffers.

    All ranks of the DP group list the segments in the same order (kind by kind, parameter by
    parameter), so a pair's sends and receives line up in ``exchange``.
    """
    dp = groups.layout.dp
    segments = zero1_segments(group.numels, group.offsets, group.partition_size, dp)
    out: list[View] = []
    for kind in kinds:
        for seg in segments:
            part_rank, dp_rank = group.part_ranks[seg.part], groups.dp_ranks[seg.dp]
            if rank not in (part_rank, dp_rank):
                continue
            name = group.names[seg.param]
            part_view = canon_view = None
            if part_rank == rank:
                base = group.offsets[seg.param] - seg.part * group.partition_size
                part_view = flats[kind][base + seg.lo : base + seg.hi]
            if dp_rank == rank:
                lo = canonical_range(group.numels[seg.param], dp, seg.dp)[0]
                canon_view = moments[(name, kind)][seg.lo - lo : seg.hi - lo]
            if to_canonical:
                out.append((part_view, canon_view, part_rank, dp_rank))
            else:
                out.append((canon_view, part_view, dp_rank, part_rank))
    return out


def _convert_moments(
    ctx: DeviceContext,
    shard: ModelShard,
    moments: dict[tuple[str, str], torch.Tensor],
    partitions: list[dict[str, torch.Tensor]],
    *,
    to_canonical: bool,
    timeout_s: float,
) -> None:
    """Copy the moments from DeepSpeed's partitions (``partitions[i][kind]``) to the canonical shares,
    or back: locally where one rank holds both ends, else over one exchange inside the DP group."""
    outgoing: dict[int, list[torch.Tensor]] = defaultdict(list)
    incoming: dict[int, list[torch.Tensor]] = defaultdict(list)
    kinds = partitioned_kinds(shard.config)
    for group, flats in zip(_zero1_groups(shard), partitions, strict=True):
        views = _moment_views(
            ctx.rank, group, shard.groups, flats, moments, kinds=kinds, to_canonical=to_canonical
        )
        for src_view, dst_view, src, dst in views:
            if src == dst:
                if dst_view.data_ptr() != src_view.data_ptr():  # type: ignore[union-attr]
                    dst_view.copy_(src_view)  # type: ignore[union-attr]
            elif src == ctx.rank:
                outgoing[dst].append(src_view)  # type: ignore[arg-type]
            else:
                incoming[src].append(dst_view)  # type: ignore[arg-type]
    tag = EXTRACT_TAG if to_canonical else INSTALL_TAG
    exchange(outgoing, incoming, tag=tag, timeout_s=timeout_s)


def _own_views(
    rank: int, shard: ModelShard, partitions: list[dict[str, torch.Tensor]]
) -> dict[tuple[str, str], torch.Tensor]:
    """The canonical shares that lie inside this rank's own ZeRO partition, as views of it.

    With dp=1 that is every share; with more, each parameter whose range stays in one partition.
    Reading or filling these needs no copy (``_convert_moments`` skips a copy onto itself).
    """
    dp, me_dp = shard.layout.dp, shard.groups.coord.dp
    kinds = partitioned_kinds(shard.config)
    out: dict[tuple[str, str], torch.Tensor] = {}
    for group, flats in zip(_zero1_groups(shard), partitions, strict=True):
        start = group.part_ranks.index(rank) * group.partition_size
        for name, numel, offset in zip(group.names, group.numels, group.offsets, strict=True):
            lo, hi = canonical_range(numel, dp, me_dp)
            if start <= offset + lo and offset + hi <= start + group.partition_size:
                for kind in kinds:
                    out[(name, kind)] = flats[kind][offset + lo - start : offset + hi - start]
    return out


def empty_state(
    stage: LlamaStage,
    smap: ShardMap,
    device: int,
    moments: dict[tuple[str, str], torch.Tensor] | None = None,
) -> DeviceState:
    """``device``'s pieces as views of ``stage``'s own parameters, of the canonical moment shares
    in ``moments`` (fresh ones where missing), and a zero step count.

    Writing into the pieces writes the stage's weights: a new stage is filled this way, and an
    old one is read this way without copying its weights.
    """
    local = stage.local_state()
    state = DeviceState(pieces={}, moments=dict(moments or {}))
    for spec, piece in smap.pieces_on(device):
        key = (spec.name, piece.box)
        if spec.kind == "param":
            if tuple(local[spec.name].shape) != piece.box.shape:
                raise ValueError(
                    f"{spec.name}: local shape {tuple(local[spec.name].shape)} on device {device}, "
                    f"but the shard map of {smap.layout.key} says {piece.box.shape}"
                )
            state.pieces[key] = local[spec.name]
        elif spec.kind == "step":
            state.pieces[key] = torch.zeros((), dtype=torch.float32)
        else:
            flat = state.moments.get((spec.param, spec.kind))
            if flat is None:
                weight = local[spec.param]
                lo, hi = canonical_range(weight.numel(), smap.layout.dp, piece.coord.dp)
                # ZeRO's partitions (masters and moments) are fp32 whatever the weights' dtype.
                flat = torch.empty(hi - lo, dtype=torch.float32, device=weight.device)
                state.moments[(spec.param, spec.kind)] = flat
            state.pieces[key] = flat[piece.offset : piece.offset + piece.box.numel].view(piece.box.shape)
    return state


def param_pieces(shard: ModelShard, smap: ShardMap, device: int) -> Pieces:
    """Views of ``device``'s parameter pieces of ``shard`` under the parameters-only map ``smap`` (a
    weight sync's source: a train stage read without its optimizer state)."""
    if state_zero3.sharded(shard):
        return state_zero3.pieces(shard, smap, device)[0]
    return empty_state(shard.stage, smap, device).pieces


def extract_state(
    ctx: DeviceContext, shard: ModelShard, smap: ShardMap, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> DeviceState:
    """This device's pieces of ``shard`` under ``smap`` (collective over its DP group when training).

    Parameters, and the moments inside this rank's own ZeRO partition, are views of the live
    state (read them, do not write them); other moments and the step count are fresh copies.
    """
    if smap.train != (shard.engine is not None):
        what = "has an optimizer" if shard.engine is not None else "has no optimizer"
        raise ValueError(f"{shard.name} {what} but the shard map says train={smap.train}")
    if state_zero3.sharded(shard):
        return DeviceState(*state_zero3.pieces(shard, smap, ctx.rank))
    if not smap.train:
        return empty_state(shard.stage, smap, ctx.rank)
    base = shard.engine.optimizer.optimizer.state
    partitions, step = [], None
    for group in _zero1_groups(shard):
        held = base.get(group.partition, {})  # empty before the first step: zero moments, step 0
        zero = torch.zeros_like(group.partition)
        partitions.append(_with_master(shard, group, {kind: held.get(kind, zero) for kind in MOMENTS}))
        step = held.get("step", step)
    state = empty_state(shard.stage, smap, ctx.rank, _own_views(ctx.rank, shard, partitions))
    if step is not None:
        state.pieces[(STEP, STEP_BOX)].copy_(step)
    _convert_moments(ctx, shard, state.moments, partitions, to_canonical=True, timeout_s=timeout_s)
    return state


def new_shard(
    ctx: DeviceContext, *, name: str, smap: ShardMap, optimizer: OptimizerSettings | None
) -> tuple[ModelShard, DeviceState]:
    """A new shard of ``name`` on ``smap``'s layout (groups built) and its pieces as destinations;
    fill them, then ``install_state``. A train stage gets its DeepSpeed engine now (collective over
    the layout's groups) with zeroed optimizer state, so that the weights and the moments inside
    this rank's ZeRO partition are received straight into the engine's own buffers."""
    if smap.train != (optimizer is not None):
        raise ValueError(
            f"{name}: a train={smap.train} shard map {'needs' if smap.train else 'takes no'} optimizer"
        )
    groups = ctx.view(smap.layout)
    stage = new_stage(smap.config, groups, ctx.device)
    shard = ModelShard(name=name, config=smap.config, groups=groups, stage=stage)
    if optimizer is None:
        return shard, empty_state(stage, smap, ctx.rank)
    shard.engine = make_engine(stage, groups, optimizer, ctx.backend)
    if state_zero3.sharded(shard):
        return shard, DeviceState(*state_zero3.pieces(shard, smap, ctx.rank, create=True))
    base = shard.engine.optimizer.optimizer.state
    partitions = []
    for group in _zero1_groups(shard):
        held = {kind: torch.zeros_like(group.partition) for kind in MOMENTS}
        # torch's AdamW keeps a 0-d float32 ``step`` per param (here: per partition); a state that
        # exists is used as is by the next step, exactly as if this engine had taken the steps.
        base[group.partition] = {"step": torch.zeros((), dtype=torch.float32), **held}
        partitions.append(_with_master(shard, group, held))
    return shard, empty_state(stage, smap, ctx.rank, _own_views(ctx.rank, shard, partitions))


def install_state(
    ctx: DeviceContext, shard: ModelShard, state: DeviceState, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> ModelShard:
    """Make ``shard`` (from ``new_shard``, its pieces filled) resident; for a train stage first put
    the rest of the moments (and masters) into ZeRO's partitions (collective over the DP group) and
    the step count into the optimizer; with fp32 weights, the weights into ZeRO's master partition."""
    if shard.engine is None:
        shard.stage.eval()
        shard.stage.requires_grad_(False)
    else:
        step = state.step
        if step is None:
            raise ValueError(f"{shard.name}: a train stage needs the step count among its pieces")
        if state_zero3.sharded(shard):
            state_zero3.install(shard, step)
            ctx.resident[shard.name] = shard
            return shard
        opt = shard.engine.optimizer
        base = opt.optimizer.state
        zero1 = _zero1_groups(shard)
        partitions = [_with_master(shard, group, base[group.partition]) for group in zero1]
        _convert_moments(ctx, shard, state.moments, partitions, to_canonical=False, timeout_s=timeout_s)
        for i, held in enumerate(partitions):
            held["step"].copy_(step)
            if MASTER not in held:
                # fp32 weights are their masters, written after the engine cloned its copy: refresh it.
                own = opt.parallel_partitioned_bit16_groups[i][dist.get_rank(opt.real_dp_process_group[i])]
                opt.single_partition_of_fp32_groups[i].data.copy_(own)
        shard.engine.global_steps = int(step.item())
    ctx.resident[shard.name] = shard
    return shard


def collect_pieces(
    ctx: DeviceContext, *, name: str, smap: ShardMap, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[tuple[str, Box, torch.Tensor]]:
    """This device's pieces of resident ``name``, cloned (run on every device of ``smap``'s layout)."""
    state = extract_state(ctx, get_shard(ctx, name), smap, timeout_s=timeout_s)
    return [(n, box, t.detach().clone().cpu()) for (n, box), t in state.pieces.items()]


def assemble_state(
    smap: ShardMap, pieces: list[tuple[int, str, Box, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Full tensors (parameters, moments, step) from ``(device, name, box, tensor)`` pieces of ``smap``.

    Raises if a tensor is not fully covered or two copies of one box differ bitwise.
    """
    full: dict[str, torch.Tensor] = {}
    seen: dict[tuple[str, Box], int] = {}
    covered: dict[str, int] = defaultdict(int)
    for device, name, box, tensor in pieces:
        spec = smap.tensor(name)
        if name not in full:
            full[name] = torch.empty(spec.shape, dtype=tensor.dtype)
        region = full[name][box.slices()]
        if (name, box) in seen:
            if not torch.equal(region, tensor):
                raise ValueError(
                    f"{name} {box}: the copies on devices {seen[(name, box)]} and {device} differ"
                )
            continue
        seen[(name, box)] = device
        region.copy_(tensor)
        covered[name] += box.numel
    for spec in smap.tensors:
        if covered[spec.name] != math.prod(spec.shape):
            raise ValueError(
                f"{spec.name}: the pieces cover {covered[spec.name]} of {math.prod(spec.shape)} elements"
            )
    return {spec.name: full[spec.name] for spec in smap.tensors}
