"""Resharding a model-stage on the device pool: plan on the driver, move the state on the devices.

    old layout ─┬─ live:    every device of either layout runs engine.reshard.live_reshard
                │           (P2P slices between actors) ──────────────────────────────┐
                └─ durable: old devices write their pieces (ArrowStateStore),         │
                            the driver commits the snapshot, every device runs        ├─> new layout
                            engine.reshard.durable_read (new devices read their boxes)┘

Boundary: the driver side. It builds the new layout's groups, plans with
``nereus_core.emu.plan_reshard``, runs the device functions and adds up their figures; the
moving itself is ``nereus_core.engine.reshard``'s. ``ArrowStateStore`` is the ``StateStore``
the durable path writes through: the Arrow snapshot store of storage/, under ``run_dir``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nereus_core import faults
from nereus_core.config import ModelConfig
from nereus_core.emu import Box, ShardMap, SliceSpec, plan_reshard, shard_map
from nereus_core.engine.exchange import DEFAULT_TIMEOUT_S
from nereus_core.engine.reshard import (
    ReshardJob,
    durable_read,
    durable_write,
    live_reshard,
    live_reshard_wave,
)
from nereus_core.engine.shard import OptimizerSettings
from nereus_core.engine.state import assemble_state, collect_pieces
from nereus_core.engine.weight_sync import SyncJob, sync_weights
from nereus_core.gtg import write_assignment
from nereus_core.layout import Layout
from storage import FileEntry, commit_snapshot, find_snapshot, read_slices, write_shard_file
from tasks.runtime.device_pool import DevicePool

Path = Literal["live", "durable"]
PATHS: tuple[str, ...] = ("live", "durable")


@dataclass(frozen=True)
class ArrowStateStore:
    """The durable path's store: snapshot ``state/<model>/step=<step>`` of ``run_dir`` (storage/FORMAT.md).
    ``incarnation``: the driver's, stamped on what it writes; what it reads must carry it (None: any)."""

    run_dir: str
    model: str
    step: int
    incarnation: int | None = None

    def write_pieces(self, device: int, pieces: Sequence[tuple[str, torch.Tensor, SliceSpec]]) -> FileEntry:
        if faults.armed("fail-snapshot-write"):
            raise faults.disk_full(f"state/{self.model}/step={self.step} device={device}")
        return write_shard_file(
            self.run_dir, self.model, self.step, device, list(pieces), incarnation=self.incarnation
        )

    def read_pieces(self, wanted: Sequence[tuple[str, Box]]) -> list[torch.Tensor]:
        ref = find_snapshot(self.run_dir, self.model, self.step, incarnation=self.incarnation)
        return read_slices(ref, list(wanted))


def _maps(config: ModelConfig, old: Layout, new: Layout, *, train: bool) -> tuple[ShardMap, ShardMap]:
    return shard_map(config, old, train=train), shard_map(config, new, train=train)


def reshard(
    pool: DevicePool,
    name: str,
    config: ModelConfig,
    old_layout: Layout,
    new_layout: Layout,
    *,
    path: Path = "live",
    optimizer: OptimizerSettings | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    store_model: str | None = None,
    step: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    incarnation: int | None = None,
    keep_old: bool = False,
) -> dict[str, Any]:
    """Move model-stage ``name`` (resident on ``old_layout``) to ``new_layout``, state and all.

    ``optimizer`` (the stage's AdamW settings) marks a train stage: its moments and step count
    move too and a new DeepSpeed engine is built on the new layout. The durable path writes
    the snapshot ``state/<store_model>/step=<step>`` under ``run_dir`` (``store_model``
    defaults to ``name`` with ``/`` as ``-``), stamped with the driver's ``incarnation``. Every
    exchange waits at most ``timeout_s``; a failure raises ``DeviceRunError`` and leaves the
    world to be rebuilt (``pool.resize``). ``keep_old`` (live): every device keeps its old shard
    aside until the switch ends (``engine.rollback``).
    Returns ``seconds``, ``bytes_moved`` and ``bytes_local`` (the plan's), and per-path figures
    (``plan_groups_s``: planning and building the new layout's groups, included in ``seconds``).
    """
    if path not in PATHS:
        raise ValueError(f"path={path!r}; choose one of {PATHS}")
    if path == "durable" and run_dir is None:
        raise ValueError("the durable path needs run_dir: the snapshot is written under it")
    start = time.perf_counter()
    old_map, new_map = _maps(config, old_layout, new_layout, train=optimizer is not None)
    plan = plan_reshard(old_map, new_map)
    job = ReshardJob(name, config, old_map, new_map, optimizer, timeout_s, keep_old and path == "live")
    pool.build_groups(new_layout)
    stats: dict[str, Any] = {
        "path": path,
        "bytes_moved": plan.bytes_moved,
        "bytes_local": plan.bytes_local,
        "plan_groups_s": time.perf_counter() - start,
    }
    if path == "live":
        stats.update(_live(pool, job, plan))
    else:
        model = store_model if store_model is not None else name.replace("/", "-")
        store = ArrowStateStore(os.fspath(run_dir), model, step, incarnation)  # type: ignore[arg-type]
        stats.update(_durable(pool, job, store))
    stats["seconds"] = time.perf_counter() - start
    return stats


def _devices(*jobs: ReshardJob | SyncJob) -> list[int]:
    devices: set[int] = set()
    for job in jobs:
        maps = (job.old_map, job.new_map) if isinstance(job, ReshardJob) else (job.source_map, job.copy_map)
        devices |= {d for smap in maps for d in smap.layout.devices}
    return sorted(devices)


def _sum_figures(figures: list[dict[str, float]]) -> dict[str, Any]:
    """The devices' figures of one exchange: totals, the slowest device's phases, the busiest port."""
    return {
        "bytes_sent": sum(f["sent"] for f in figures),
        "messages": sum(f["messages"] for f in figures),
        "busiest_port_bytes": max(max(f["sent"], f["received"]) for f in figures),
        "exchange_s": max(f["exchange_s"] for f in figures),
        "prepare_s": max(f["prepare_s"] for f in figures),
        "install_s": max(f["install_s"] for f in figures),
        "device_s": max(f["prepare_s"] + f["exchange_s"] + f["install_s"] for f in figures),
    }


def _live(pool: DevicePool, job: ReshardJob, plan: Any) -> dict[str, Any]:
    return _sum_figures(pool.run_on(_devices(job), live_reshard, job=job, plan=plan))


def reshard_wave(
    pool: DevicePool,
    moves: Sequence[tuple[str, ModelConfig, Layout, Layout, OptimizerSettings | None]],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    keep_old: bool = False,
) -> list[dict[str, Any]]:
    """Live-reshard several model-stages at once: ``(name, config, old, new, optimizer)`` each, in one
    device call per device (``engine.reshard.live_reshard_wave``); one figures dict per move, as
    ``reshard`` returns (``seconds`` is the whole wave's: the moves ran together). ``keep_old``: as
    ``reshard``'s."""
    start = time.perf_counter()
    units = []
    for name, config, old, new, optimizer in moves:
        old_map, new_map = _maps(config, old, new, train=optimizer is not None)
        plan = plan_reshard(old_map, new_map)
        units.append((ReshardJob(name, config, old_map, new_map, optimizer, timeout_s, keep_old), plan))
        pool.build_groups(new)
    planned = time.perf_counter() - start
    per_device = pool.run_on(_devices(*(job for job, _ in units)), live_reshard_wave, units=units)
    seconds = time.perf_counter() - start
    out = []
    for i, (_, plan) in enumerate(units):
        figures = [device[i] for device in per_device]
        stats = {"path": "live", "bytes_moved": plan.bytes_moved, "bytes_local": plan.bytes_local}
        out.append({**stats, "plan_groups_s": planned, **_sum_figures(figures), "seconds": seconds})
    return out


def sync_copy(
    pool: DevicePool,
    config: ModelConfig,
    *,
    source: str,
    source_layout: Layout,
    copy: str,
    copy_layout: Layout,
    create: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Give inference copy ``copy`` (on ``copy_layout``) the parameters of ``source`` (on
    ``source_layout``) device to device, with the EMU reshard plan of the two layouts (parameters
    only; the optimizer state stays). ``create`` builds the copy first (its groups too), else it
    must be resident. Returns ``seconds``, the plan's ``bytes_moved``/``bytes_local`` and the
    devices' figures (``busiest_port_bytes``: the most one device sent or received)."""
    start = time.perf_counter()
    job = SyncJob(
        source,
        copy,
        shard_map(config, source_layout, train=False),
        shard_map(config, copy_layout, train=False),
        create=create,
        timeout_s=timeout_s,
    )
    plan = plan_reshard(job.source_map, job.copy_map)
    if create:
        pool.build_groups(copy_layout)
    figures = pool.run_on(_devices(job), sync_weights, job=job, plan=plan)
    stats = {"path": "sync", "bytes_moved": plan.bytes_moved, "bytes_local": plan.bytes_local}
    return {**stats, **_sum_figures(figures), "seconds": time.perf_counter() - start}


def write_snapshot_of(
    pool: DevicePool, job: ReshardJob, store: ArrowStateStore, meta: dict[str, Any]
) -> list[FileEntry]:
    """The devices of ``job``'s old layout write their pieces (each distinct box once) and the driver
    commits them as ``store``'s snapshot; returns the files."""
    old = job.old_map.layout
    assignment = write_assignment(job.old_map)
    files = pool.run(old, durable_write, [(assignment[d],) for d in old.devices], job=job, store=store)
    commit_snapshot(
        store.run_dir, store.model, store.step, files, layout=old, meta=meta, incarnation=store.incarnation
    )
    return files


def _durable(pool: DevicePool, job: ReshardJob, store: ArrowStateStore) -> dict[str, Any]:
    t0 = time.perf_counter()
    meta = {"model_stage": job.name, "reshard_to": job.new_map.layout.key}
    files = write_snapshot_of(pool, job, store, meta)
    t1 = time.perf_counter()
    figures = pool.run_on(_devices(job), durable_read, job=job, store=store)
    return {
        "bytes_written": sum(f.size for f in files),
        "bytes_read": sum(f["read"] for f in figures),
        "write_s": t1 - t0,
        "read_s": max(f["read_s"] for f in figures),
        "install_s": max(f["install_s"] for f in figures),
    }


def gather_state(
    pool: DevicePool,
    layout: Layout,
    *,
    name: str,
    config: ModelConfig,
    train: bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, torch.Tensor]:
    """The full state of ``name`` on the driver: parameters, and for train stages every moment
    (from every device's canonical ZeRO-1 share) and the step count; replicas must agree bitwise."""
    smap = shard_map(config, layout, train=train)
    results = pool.run(layout, collect_pieces, name=name, smap=smap, timeout_s=timeout_s)
    pieces = [(d, n, box, t) for d, got in zip(layout.devices, results, strict=True) for n, box, t in got]
    return assemble_state(smap, pieces)
