"""The vocabulary of a Global Transition Graph: operations, edges and the link model that times them.

An operation is a frozen record with a stable id (the journal records operations by id, so an id
names the same work in every process and after a restart). Nothing here schedules anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nereus_core.emu import Box

OpKind = Literal["regroup", "alloc", "transfer", "copy", "free", "snapshot", "rehydrate", "commit"]
EdgeKind = Literal["data", "memory", "port"]
Port = tuple[str, int]  # ("send" | "recv" | "copy" | "store", device)


class TransitionInfeasible(ValueError):
    """Plan B does not fit some device even when every old shard is snapshotted and freed first."""


class ScheduleInvalid(AssertionError):
    """``TransitionGraph.validate`` found a schedule that breaks capacity, data order or coverage."""


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of a transition.

    ``alloc``/``free``/``snapshot``/``rehydrate`` act on the shard of ``stage`` on ``device``;
    ``transfer`` sends ``region`` (global coordinates) of ``tensor`` from ``src`` to ``dst``;
    ``copy`` is the same with ``src == dst == device`` (no link bytes). ``index`` tells apart the
    regions of one tensor moved between the same pair. ``nbytes``: bytes allocated, freed,
    written, read or moved.
    """

    kind: OpKind
    stage: str = ""
    device: int | None = None
    src: int | None = None
    dst: int | None = None
    tensor: str = ""
    region: Box | None = None
    index: int = 0
    nbytes: int = 0

    @property
    def id(self) -> str:
        """Stable id, e.g. ``alloc:actor/train:3``, ``transfer:actor/train:3->1:lm_head.weight:0``."""
        if self.kind in ("regroup", "commit"):
            return self.kind
        if self.kind == "transfer":
            return f"transfer:{self.stage}:{self.src}->{self.dst}:{self.tensor}:{self.index}"
        if self.kind == "copy":
            return f"copy:{self.stage}:{self.device}:{self.tensor}:{self.index}"
        return f"{self.kind}:{self.stage}:{self.device}"

    @property
    def link_bytes(self) -> int:
        """Bytes over a link between devices (transfers only; copies stay on their device)."""
        return self.nbytes if self.kind == "transfer" else 0

    @property
    def ports(self) -> tuple[Port, ...]:
        """The serial resources the op occupies while it runs (see ``LinkModel``)."""
        if self.kind == "transfer":
            return (("send", self.src), ("recv", self.dst))  # type: ignore[return-value]
        if self.kind == "copy":
            return (("copy", self.device),)  # type: ignore[return-value]
        if self.kind in ("snapshot", "rehydrate"):
            return (("store", self.device),)  # type: ignore[return-value]
        return ()

    @property
    def link(self) -> str | None:
        """The link the op's bytes travel on: ``'3->1'``, ``'3->store'``, ``'store->1'``, or None."""
        if self.kind == "transfer":
            return f"{self.src}->{self.dst}"
        if self.kind == "snapshot":
            return f"{self.device}->store"
        if self.kind == "rehydrate":
            return f"store->{self.device}"
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus the id; ``region`` as ``[start, stop]`` lists."""
        out: dict[str, Any] = {"id": self.id, "kind": self.kind, "nbytes": self.nbytes}
        for name in ("stage", "device", "src", "dst", "tensor"):
            value = getattr(self, name)
            if value not in ("", None):
                out[name] = value
        if self.kind in ("transfer", "copy"):
            out["index"] = self.index
        if self.region is not None:
            out["region"] = [list(self.region.start), list(self.region.stop)]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Op:
        """The op ``to_dict`` wrote (the id is recomputed and checked)."""
        fields = {k: v for k, v in data.items() if k not in ("id", "region")}
        region = data.get("region")
        op = cls(**fields, region=Box(tuple(region[0]), tuple(region[1])) if region is not None else None)
        if "id" in data and data["id"] != op.id:
            raise ValueError(f"op id {data['id']!r} does not match its fields (they give {op.id!r})")
        return op


@dataclass(frozen=True, slots=True)
class Edge:
    """``before`` must finish before ``after`` starts.

    ``data``: the bytes need it (alloc before transfers into a shard, transfers out of a shard
    before its free, regroup before transfers, snapshots before rehydrates). ``memory``: a device
    cannot hold both (a free before an alloc on the same device, or allocs on a tight device kept
    in the order the memory check assumed). ``port``: the order chosen for two operations that use
    the same link port; dropping these keeps the schedule safe but changes its timing.
    """

    before: str
    after: str
    kind: EdgeKind

    def to_list(self) -> list[str]:
        return [self.before, self.after, self.kind]


class LinkModel(BaseModel):
    """How long an operation takes: ``nbytes / bandwidth + op_overhead_s``.

    Every device has four serial ports: ``send`` and ``recv`` (full duplex: a device sends one
    transfer and receives another at once, as NCCL/gloo point-to-point do), ``copy`` (same-device
    copies at ``local_bandwidth``) and ``store`` (snapshots and rehydrates at ``store_bandwidth``,
    per device). Operations sharing a port run one after another; operations on disjoint ports
    run concurrently. Slot ``d`` is on node ``d // devices_per_node``. Defaults: the CPU runtime
    (gloo send 1.4 GB/s and 7.5 GB/s copies, measured as ``nereus_core/cost/hardware.py`` says;
    store, overheads and regroup assumed) — pass a calibrated model for anything else.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    intra_node_bandwidth: float = Field(
        default=1.4e9, gt=0, description="Device-to-device bytes/s, same node."
    )
    inter_node_bandwidth: float = Field(
        default=1.4e9, gt=0, description="Device-to-device bytes/s, across nodes."
    )
    devices_per_node: int = Field(default=8, ge=1, description="Device slots per node.")
    local_bandwidth: float = Field(default=7.5e9, gt=0, description="Same-device copy bytes/s.")
    store_bandwidth: float = Field(default=1e9, gt=0, description="Snapshot/rehydrate bytes/s per device.")
    op_overhead_s: float = Field(
        default=1e-3, ge=0, description="Fixed cost of one transfer, copy, snapshot or rehydrate, s."
    )
    shard_op_s: float = Field(default=1e-4, ge=0, description="Cost of one alloc or free, s.")
    regroup_s: float = Field(default=0.05, ge=0, description="Building the new layouts' process groups, s.")
    commit_s: float = Field(default=1e-3, ge=0, description="Switching to plan B, s.")

    def bandwidth(self, src: int, dst: int) -> float:
        """Bytes/s from ``src`` to ``dst`` (``local_bandwidth`` when they are the same slot)."""
        if src == dst:
            return self.local_bandwidth
        same_node = src // self.devices_per_node == dst // self.devices_per_node
        return self.intra_node_bandwidth if same_node else self.inter_node_bandwidth

    def duration(self, op: Op) -> float:
        """Seconds ``op`` occupies its ports."""
        if op.kind == "transfer":
            return self.op_overhead_s + op.nbytes / self.bandwidth(op.src, op.dst)  # type: ignore[arg-type]
        if op.kind == "copy":
            return self.op_overhead_s + op.nbytes / self.local_bandwidth
        if op.kind in ("snapshot", "rehydrate"):
            return self.op_overhead_s + op.nbytes / self.store_bandwidth
        if op.kind in ("alloc", "free"):
            return self.shard_op_s
        return self.regroup_s if op.kind == "regroup" else self.commit_s
