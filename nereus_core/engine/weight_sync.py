"""Weight sync: an inference copy of a trained model-stage takes its new parameters device to device.

After ``actor/train`` (``critic/train``) steps, the inference copy ``actor/generate``
(``critic/infer``) on another layout must hold the same parameters. The two layouts' shard maps
(parameters only: a copy has no optimizer state, and the train stage's moments never move) give
a ``plan_reshard`` plan; every device of either layout runs ``sync_weights`` at once: train
devices post the sends of their parameter slices, copy devices receive straight into the copy's
existing weights (only the regions they lack), a device holding both copies locally. The bytes
go device to device (``engine.exchange``), never through the driver. On the same layout the
copy shares the train stage's shards instead (``engine.shard.alias_shard``): nothing to sync.

Boundary: the device side of one sync; planning and dispatch are the pool's (tasks/reshard.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from nereus_core.emu import ReshardPlan, ShardMap
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.exchange import DEFAULT_TIMEOUT_S, Exchange
from nereus_core.engine.reshard import copy_local, receives_of, sends_of
from nereus_core.engine.shard import ModelShard, get_shard
from nereus_core.engine.state import DeviceState, Pieces, empty_state, install_state, new_shard, param_pieces

SYNC_TAG = 4 << 20  # the reshard's exchanges use 1, 2 and 3 << 20


@dataclass(frozen=True)
class SyncJob:
    """Copy the parameters of model-stage ``source`` (``source_map``) into ``copy`` (``copy_map``).

    ``create``: the copy is built on its layout first (a relink after a transition); otherwise it
    must be resident there already (the weight sync of a step).
    """

    source: str
    copy: str
    source_map: ShardMap
    copy_map: ShardMap
    create: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.source_map.train or self.copy_map.train:
            raise ValueError("a weight sync moves parameters only: both shard maps need train=False")
        if self.source_map.config != self.copy_map.config:
            raise ValueError(f"{self.copy} is not a copy of {self.source}: their model configs differ")


def _source_pieces(ctx: DeviceContext, job: SyncJob) -> Pieces:
    """Views of this device's parameter slices of the trained stage (none if not in its layout)."""
    if ctx.rank not in job.source_map.layout.devices:
        return {}
    return param_pieces(get_shard(ctx, job.source), job.source_map, ctx.rank)


def _copy_target(ctx: DeviceContext, job: SyncJob) -> tuple[ModelShard | None, DeviceState]:
    """The copy's pieces as destinations (views of its weights), and a shard to install if it is new."""
    if ctx.rank not in job.copy_map.layout.devices:
        return None, DeviceState(pieces={})
    if job.create:
        return new_shard(ctx, name=job.copy, smap=job.copy_map, optimizer=None)
    held = get_shard(ctx, job.copy)
    if held.engine is not None:
        raise ValueError(f"{job.copy} is a train stage on device {ctx.rank}; only inference copies sync")
    if held.layout.key != job.copy_map.layout.key:
        raise ValueError(
            f"{job.copy} is resident on {held.layout.key} on device {ctx.rank}, "
            f"not on {job.copy_map.layout.key}: reload it on the plan's layout"
        )
    return None, empty_state(held.stage, job.copy_map, ctx.rank)


@torch.no_grad()
def sync_weights(ctx: DeviceContext, *, job: SyncJob, plan: ReshardPlan) -> dict[str, float]:
    """Run ``plan`` (source map -> copy map) on this device; every device of either layout at once.

    Returns this rank's bytes sent and received, messages, and seconds. After a failure the world
    must be rebuilt (a gloo pair that timed out is closed); the copy may be half written.
    """
    start = time.perf_counter()
    # Receives first: a peer's send moves no bytes before they are posted (engine.exchange).
    shard, target = _copy_target(ctx, job)
    moves = Exchange(tag=SYNC_TAG, timeout_s=job.timeout_s)
    moves.recv(receives_of(ctx.rank, plan, target.pieces))
    source = _source_pieces(ctx, job)
    moves.send(sends_of(ctx.rank, plan, source))
    posted = time.perf_counter()
    copy_local(ctx.rank, plan, source, target.pieces)
    moved = moves.wait()
    exchanged = time.perf_counter()
    if shard is not None:
        install_state(ctx, shard, target, timeout_s=job.timeout_s)
    return {
        "sent": moved.sent,
        "received": moved.received,
        "messages": moved.messages,
        "prepare_s": posted - start,
        "exchange_s": exchanged - posted,
        "install_s": time.perf_counter() - exchanged,
    }
