"""Carrying out a reshard plan on the devices: live (slices sent between device actors) or durable.

A reshard moves a model-stage's whole state (parameters; for train stages also AdamW's
moments and step count) from one layout to another, as ``nereus_core.emu.plan_reshard`` says:

- live: every device of either layout runs ``live_reshard`` at once. Old devices read their
  pieces (``state.extract_state``; weights, and moments in their own ZeRO partition, without
  a copy) and post their sends; new devices build the new shard (``state.new_shard``; for a
  train stage with its DeepSpeed engine, so that pieces land in the engine's own buffers) and
  post their receives; same-device regions are copied; one point-to-point exchange
  (``engine.exchange``: runs of small slices packed per peer, large ones sent in place)
  carries the rest. Then the old shard is dropped and the new one installed.
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

from nereus_core.config import ModelConfig
from nereus_core.emu import Box, ReshardPlan, ShardMap, SliceSpec
from nereus_core.engine.exchange import DEFAULT_TIMEOUT_S, Exchange
from nereus_core.engine.shard import ModelShard, OptimizerSettings, get_shard
from nereus_core.engine.state import DeviceState, extract_state, install_state, new_shard
from nereus_core.parallel.device import DeviceContext

LIVE_TAG = 3 << 20
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

    def __post_init__(self) -> None:
        if self.old_map.train != self.new_map.train:
            raise ValueError("a reshard keeps the stage kind: both shard maps must agree on train")
        if self.new_map.train != (self.optimizer is not None):
            need = "needs optimizer settings" if self.new_map.train else "takes no optimizer settings"
            raise ValueError(f"{self.name}: a train={self.new_map.train} reshard {need}")


def _old_state(ctx: DeviceContext, job: ReshardJob) -> DeviceState:
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
    start = time.perf_counter()
    me = ctx.rank
    source = _old_state(ctx, job).pieces
    # Sends first: the bytes flow while this device (and its peers) allocate the new stage.
    moves = Exchange(tag=LIVE_TAG, timeout_s=job.timeout_s)
    outgoing: dict[int, list[torch.Tensor]] = defaultdict(list)
    for t in plan.transfers:
        if t.src == me:
            outgoing[t.dst].append(source[(t.name, t.src_piece.box)][t.src_slice.slices()])
    moves.send(outgoing)
    shard, target = _new_target(ctx, job)
    prepared = time.perf_counter()
    incoming: dict[int, list[torch.Tensor]] = defaultdict(list)
    for t in plan.transfers:
        if t.dst == me:
            incoming[t.src].append(target.pieces[(t.name, t.dst_piece.box)][t.dst_slice.slices()])
    moves.recv(incoming)
    for t in plan.local:
        if t.dst == me:
            dst = target.pieces[(t.name, t.dst_piece.box)][t.dst_slice.slices()]
            dst.copy_(source[(t.name, t.src_piece.box)][t.src_slice.slices()])
    moved = moves.wait()
    del source, outgoing
    exchanged = time.perf_counter()
    ctx.resident.pop(job.name, None)
    _install(ctx, job, shard, target)
    return {
        "sent": moved.sent,
        "received": moved.received,
        "messages": moved.messages,
        "prepare_s": prepared - start,
        "exchange_s": exchanged - prepared,
        "install_s": time.perf_counter() - exchanged,
    }


def durable_write(ctx: DeviceContext, mine: Wanted, *, job: ReshardJob, store: StateStore) -> Any:
    """Write this old device's assigned pieces to ``store`` (all old devices at once); returns the receipt."""
    if ctx.rank not in job.old_map.layout.devices:
        raise ValueError(f"device {ctx.rank} is not in the old layout {job.old_map.layout.key}")
    source = _old_state(ctx, job).pieces
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
