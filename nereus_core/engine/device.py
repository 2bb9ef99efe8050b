"""One device slot's view of the torch.distributed world.

A ``DeviceContext`` lives inside one device actor (the Dask glue in ``tasks/``
owns it) and is handed to every core function the actor runs. It knows its
world rank, the process groups of each layout it has built, and the objects
resident on this device (model shards, engines). It knows nothing about Dask or
the environment: whoever owns it decides where the rendezvous is and on which
interface it listens.

Group creation follows torch.distributed's rule that ``new_group`` is called by
every rank of the world, for every group, in the same order; ``build_groups``
does exactly that for one layout, so callers must call it on all devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nereus_core.layout import Coord, Layout


@dataclass(frozen=True)
class RankGroups:
    """This device's place in one layout, with the process groups it belongs to."""

    layout: Layout
    index: int
    coord: Coord
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    replica_group: dist.ProcessGroup
    tp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.layout.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """World rank of the previous pipeline stage, or None on the first."""
        return None if self.is_first_stage else self.pp_ranks[self.coord.pp - 1]

    @property
    def next_rank(self) -> int | None:
        """World rank of the next pipeline stage, or None on the last."""
        return None if self.is_last_stage else self.pp_ranks[self.coord.pp + 1]


@dataclass
class DeviceContext:
    """The distributed state of one device slot (one actor)."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    groups: dict[str, RankGroups | None] = field(default_factory=dict)
    resident: dict[str, Any] = field(default_factory=dict)
    background: dict[str, Any] = field(default_factory=dict)  # writes in flight (engine/staging.py)
    retired: dict[str, Any] = field(default_factory=dict)  # old shards kept by a live switch (rollback.py)

    @classmethod
    def init_world(
        cls,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        listen_fd: int | None = None,
    ) -> DeviceContext:
        """Join the world as ``rank``; every rank must call this with the same address.

        The rendezvous store is created here rather than by an ``init_method`` URL, so that rank 0
        serves it on ``listen_fd``: a listening socket its caller bound to ``master_addr`` (the store
        then listens on that interface only; it owns and closes the socket). Without one, torch binds
        every interface. Whatever DeepSpeed reads from the environment is the caller's.
        """
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            master_listen_fd=listen_fd if rank == 0 else None,
        )
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return cls(rank=rank, world_size=world_size, backend=backend, device=device)

    def destroy_world(self) -> None:
        """Leave the world; groups die with it, resident objects stay (they hold plain tensors)."""
        self.groups.clear()
        if dist.is_initialized():
            dist.destroy_process_group()

    def build_groups(self, layout: Layout) -> RankGroups | None:
        """Create the groups of ``layout`` collectively; returns this device's view, None if not a member."""
        if layout.key in self.groups:
            return self._as(self.groups[layout.key], layout)
        if max(layout.devices) >= self.world_size:
            raise ValueError(f"layout {layout.key} uses slots beyond the world of {self.world_size}")
        mine: dict[str, tuple[tuple[int, ...], dist.ProcessGroup]] = {}
        for kind, ranks_list in (
            ("tp", layout.tp_groups()),
            ("pp", layout.pp_groups()),
            ("dp", layout.dp_groups()),
            ("replica", layout.replica_groups()),
        ):
            for ranks in ranks_list:
                group = dist.new_group(ranks=list(ranks))
                if self.rank in ranks:
                    mine[kind] = (ranks, group)
        view = None
        if self.rank in layout.devices:
            index = layout.devices.index(self.rank)
            view = RankGroups(
                layout=layout,
                index=index,
                coord=layout.coord(index),
                tp_group=mine["tp"][1],
                pp_group=mine["pp"][1],
                dp_group=mine["dp"][1],
                replica_group=mine["replica"][1],
                tp_ranks=mine["tp"][0],
                pp_ranks=mine["pp"][0],
                dp_ranks=mine["dp"][0],
            )
        self.groups[layout.key] = view
        return view

    def view(self, layout: Layout) -> RankGroups:
        """This device's view of a layout whose groups were built; raises if not a member."""
        view = self.groups.get(layout.key)
        if view is None:
            raise KeyError(f"device {self.rank} has no groups for layout {layout.key}; build them first")
        return self._as(view, layout)

    @staticmethod
    def _as(view: RankGroups | None, layout: Layout) -> RankGroups | None:
        """The groups of a placement serve every layout on it (the key names the placement), each with
        its own micro-batches: two model-stages on the same slots may split their batches apart."""
        if view is None or view.layout == layout:
            return view
        return replace(view, layout=layout)
