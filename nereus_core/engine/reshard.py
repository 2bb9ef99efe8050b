"""Carrying out a reshard plan on the devices: live (slices sent between device actors) or durable.

A reshard moves a model-stage's whole state (parameters; for train stages also AdamW's
moments and step count) from one layout to another, as ``nereus_core.emu.plan_reshard`` says:

- live: every device of either layout runs ``live_reshard`` at once. New devices build the
  new shard (``state.new_shard``; for a train stage with its DeepSpeed engine, so that pieces
  land in the engine's own buffers) and post their receives; old devices read their pieces
  (``state.extract_state``; weights, and moments in their own ZeRO partition, without a
  copy) and post their sends; same-device regions are copied while one point-to-point
  exchange (``engine.exchange``: runs of small slices packed per peer, large ones sent in
  place) carries the rest. Then the old shard is dropped (or, with ``keep_old``, kept aside until
  the switch ends: ``engine.rollback``) and the new one installed.
- durable: old devices write their pieces to a ``StateStore`` (``durable_write``; each box of
  a replicated tensor by one holder only, ``write_assignment``), the caller commits the
  snapshot, and every device runs ``durable_read``: the old shard is dropped, new devices read
  exactly their boxes back and install them.

Boundary: device-side functions over one ``DeviceContext`` (the pool in tasks/ runs them on
the right devices). The store is a Protocol: nereus_core never imports storage.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nereus_core import faults
from nereus_core.config import ModelConfig
from nereus_core.emu import Box, ReshardPlan, ShardMap, SliceSpec
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.exchange import DEFAULT_TIMEOUT_S, Exchange
from nereus_core.engine.shard import ModelShard, OptimizerSettings, get_shard
from nereus_core.engine.state import DeviceState, Pieces, extract_state, install_state, new_shard

LIVE_TAG = 3 << 20
UNIT_TAGS = 1 << 16  # tags per unit of a wave: its messages to one peer number fewer than this
Wanted = list[tuple[str, Box]]


class StateStore(Protocol):
    """Where the durable path puts a device's pieces and gets boxes back (storage/ implements it)."""

    def write_pieces(self, device: int, pieces: Sequence[tuple[str, torch.Tensor, SliceSpec]]) -> Any:
        """Persist ``device``'s pieces; returns a picklable receipt the driver commits."""
        ...

    def read_pieces(self, wanted: Sequence[tuple[str, Box]]) -> list[torch.Tensor]:
        """Fresh tensors of the ``(name, box)`` regions asked for, in order, from the committed snapshot."""
        ...


@dataclass(frozen=True)
class ReshardJob:
    """What every device needs to know about one reshard of model-stage ``name``."""

    name: str
    config: ModelConfig
    old_map: ShardMap
    new_map: ShardMap
    optimizer: OptimizerSettings | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    keep_old: bool = False  # the old shard waits in ``ctx.retired`` for the switch's end (engine/rollback.py)

    def __post_init__(self) -> None:
        if self.old_map.train != self.new_map.train:
            raise ValueError("a reshard keeps the stage kind: both shard maps must agree on train")
        if self.new_map.train != (self.optimizer is not None):
            need = "needs optimizer settings" if self.new_map.train else "takes no optimizer settings"
            raise ValueError(f"{self.name}: a train={self.new_map.train} reshard {need}")


def old_state(ctx: DeviceContext, job: ReshardJob) -> DeviceState:
    """This device's pieces under the old layout (none if it is not in it)."""
    if ctx.rank not in job.old_map.layout.devices:
        return DeviceState(pieces={})
    return extract_state(ctx, get_shard(ctx, job.name), job.old_map, timeout_s=job.timeout_s)


def _new_target(ctx: DeviceContext, job: ReshardJob) -> tuple[ModelShard | None, DeviceState]:
    """The new shard and its pieces as destinations, on devices of the new layout (see ``new_shard``)."""
    if ctx.rank not in job.new_map.layout.devices:
        return None, DeviceState(pieces={})
    return new_shard(ctx, name=job.name, smap=job.new_map, optimizer=job.optimizer)


def _install(ctx: DeviceContext, job: ReshardJob, shard: ModelShard | None, state: DeviceState) -> None:
    """Make the filled new shard resident (collective over the new layout's DP group), if there is one."""
    if shard is not None:
        install_state(ctx, shard, state, timeout_s=job.timeout_s)


def live_reshard(ctx: DeviceContext, job: ReshardJob, plan: ReshardPlan) -> dict[str, float]:
    """Run ``plan`` on this device (every device of either layout at once); returns this rank's figures.

    The new layout's groups must exist. After a failure the world must be rebuilt (a gloo pair
    that timed out is closed) and the old shard may be gone from devices that got that far.
    """
    return live_reshard_wave(ctx, [(job, plan)])[0]


def live_reshard_wave(
    ctx: DeviceContext, units: Sequence[tuple[ReshardJob, ReshardPlan]]
) -> list[dict[str, float]]:
    """Run several reshards of different model-stages at once on this device (every device of any of
    their layouts runs this with the same ``units`` in the same order); one figures dict per unit.

    Each phase goes over the units in the given order: build the new shards and post the
    receives, read the old pieces and post the sends, copy locally, then await every exchange,
    then drop the old shards and install the new ones. Receives go first because a peer's send
    moves no bytes before its receive is posted (gloo waits for it), and a device that both
    sends and receives would otherwise hold its peers up while it packs its own sends. Every
    collective (DeepSpeed's engine set-up, ZeRO's DP-group exchanges) is thus entered by its
    members in one global order, so none can wait on a device busy in another; each unit's
    point-to-point messages carry their own tags
    (``LIVE_TAG + i * UNIT_TAGS``), so the units' bytes between one pair never match each other's.
    Memory: every new shard of the wave is allocated before any old one is freed, which is what
    the GTG's replay of a wave counts (nereus_core/gtg/execution.py).
    """
    if len({job.name for job, _ in units}) != len(units):
        raise ValueError(f"a wave moves each model-stage once; got {[job.name for job, _ in units]}")
    if len(units) * UNIT_TAGS > LIVE_TAG:
        raise ValueError(f"at most {LIVE_TAG // UNIT_TAGS} units per wave; got {len(units)}")
    start = time.perf_counter()
    moves, targets = [], []
    for i, (job, plan) in enumerate(units):  # receives first: a peer's send moves once they are posted
        targets.append(_new_target(ctx, job))
        moves.append(Exchange(tag=LIVE_TAG + i * UNIT_TAGS, timeout_s=job.timeout_s))
        moves[-1].recv(receives_of(ctx.rank, plan, targets[-1][1].pieces))
    sources = []
    for (job, plan), exch in zip(units, moves, strict=True):
        sources.append(old_state(ctx, job).pieces)
        exch.send(sends_of(ctx.rank, plan, sources[-1]))
    prepared = time.perf_counter() - start
    for (_, plan), source, (_, target) in zip(units, sources, targets, strict=True):
        copy_local(ctx.rank, plan, source, target.pieces)  # while the bytes move
    moved = [exch.wait() for exch in moves]
    del sources
    exchanged = time.perf_counter()
    installs = []
    for (job, _), (shard, target) in zip(units, targets, strict=True):
        t0 = time.perf_counter()
        old = ctx.resident.pop(job.name, None)
        if job.keep_old and old is not None:
            ctx.retired.setdefault(job.name, old)
        _install(ctx, job, shard, target)
        installs.append(time.perf_counter() - t0)
    if faults.armed("fail-worker:move"):
        raise RuntimeError(f"injected fault: device {ctx.rank} fails after installing {len(units)} stage(s)")
    return [
        {
            "sent": m.sent,
            "received": m.received,
            "messages": m.messages,
            # The wave's shared phases are charged to every unit: they ran at once.
            "prepare_s": prepared,
            "exchange_s": exchanged - start - prepared,
            "install_s": sum(installs),
        }
        for m in moved
    ]


def sends_of(me: int, plan: ReshardPlan, source: Pieces) -> dict[int, list[torch.Tensor]]:
    """What device ``me`` sends under ``plan``: views of its ``source`` pieces, per destination."""
    out: dict[int, list[torch.Tensor]] = defaultdict(list)
    for t in plan.transfers:
        if t.src == me:
            out[t.dst].append(source[(t.name, t.src_piece.box)][t.src_slice.slices()])
    return out


def receives_of(me: int, plan: ReshardPlan, target: Pieces) -> dict[int, list[torch.Tensor]]:
    """Where device ``me`` receives under ``plan``: views of its ``target`` pieces, per source."""
    out: dict[int, list[torch.Tensor]] = defaultdict(list)
    for t in plan.transfers:
        if t.dst == me:
            out[t.src].append(target[(t.name, t.dst_piece.box)][t.dst_slice.slices()])
    return out


def copy_local(me: int, plan: ReshardPlan, source: Pieces, target: Pieces) -> None:
    """``plan``'s same-device regions on device ``me``, copied (a region that is itself: skipped)."""
    for t in plan.local:
        if t.dst == me:
            dst = target[(t.name, t.dst_piece.box)][t.dst_slice.slices()]
            src = source[(t.name, t.src_piece.box)][t.src_slice.slices()]
            if dst.data_ptr() != src.data_ptr() or dst.shape != src.shape:
                dst.copy_(src)


def durable_write(ctx: DeviceContext, mine: Wanted, *, job: ReshardJob, store: StateStore) -> Any:
    """Write this old device's assigned pieces to ``store`` (all old devices at once); returns the receipt."""
    if ctx.rank not in job.old_map.layout.devices:
        raise ValueError(f"device {ctx.rank} is not in the old layout {job.old_map.layout.key}")
    source = old_state(ctx, job).pieces
    pieces = [
        (name, source[(name, box)], SliceSpec(job.old_map.tensor(name).shape, box)) for name, box in mine
    ]
    return store.write_pieces(ctx.rank, pieces)


def durable_read(ctx: DeviceContext, *, job: ReshardJob, store: StateStore) -> dict[str, float]:
    """Drop the old shard (the snapshot is committed); on new devices read exactly this device's boxes
    and install them."""
    start = time.perf_counter()
    ctx.resident.pop(job.name, None)
    shard, target = _new_target(ctx, job)
    wanted = job.new_map.wanted(ctx.rank) if shard is not None else []
    read = 0
    for (name, box), tensor in zip(wanted, store.read_pieces(wanted) if wanted else [], strict=True):
        target.pieces[(name, box)].copy_(tensor.view(box.shape))
        read += tensor.numel() * tensor.element_size()
    loaded = time.perf_counter()
    _install(ctx, job, shard, target)
    return {"read": read, "read_s": loaded - start, "install_s": time.perf_counter() - loaded}
