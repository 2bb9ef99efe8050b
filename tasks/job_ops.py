"""The job's whole-state operations on the pool: load every model-stage, checkpoint, digest, probe.

Boundary: each call carries out one thing the job flow asks for on the device pool and the run
directory; what to do and when is nereus_core.job's. The checkpoint and the verification are
Prefect tasks (the UI shows and times them); the helpers they share are plain calls.

Verification is against live memory, never against the checkpoint a state was loaded from:
``live_digests`` gathers every model's full state (parameters, AdamW moments, step count) from
the devices that hold it and hashes it, so "before the switch" and "after the switch" (or "when
the checkpoint was written" and "after resume rehydrated it") are two independent readings.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nereus_core import faults
from nereus_core.config import NereusConfig
from nereus_core.count_task import make_prompts
from nereus_core.engine.hf_load import hf_source
from nereus_core.engine.memory import held_bytes as device_held_bytes
from nereus_core.job import JobState, model_config, optimizer_settings
from nereus_core.layout import Layout
from nereus_core.plan import ModelStage, copies, layouts_json, load_order, state_stages
from storage.run_dir import RunDir
from tasks import model_ops
from tasks.reshard import gather_state
from tasks.runtime.device_pool import DevicePool
from tasks.snapshots import StagedSnapshot, drop_snapshot, finish_snapshot, snapshot_model, stage_snapshot

# The actor's log-probs and, where the job has a critic, its values.
PROBED = (ModelStage.ACTOR_TRAIN, ModelStage.CRITIC_TRAIN)


def load_models(
    pool: DevicePool,
    config: NereusConfig,
    layouts: Mapping[ModelStage, Layout],
    aliased: frozenset[ModelStage],
    reward_state: dict[str, torch.Tensor] | None,
) -> None:
    """Every model-stage on its layout: from the model directories of the config where it names them
    (``engine.hf_load.hf_source``: each device reads its own slices), else own state from the seed (the
    reward model and the critic from the fitted reward model, as OpenRLHF starts the critic); copies
    sharing their source, or loaded as it is."""
    sources = copies(layouts)
    for stage in load_order(layouts):
        layout = layouts[stage]
        if stage in aliased:
            model_ops.alias_model(pool, layout, name=stage, target=sources[stage])
            continue
        source = hf_source(config, stage.model)
        if source is not None:
            model_ops.import_model(
                pool,
                layout,
                name=stage,
                config=model_config(config, stage),
                source=source,
                optimizer=optimizer_settings(config, stage),
            )
            continue
        full = reward_state if stage.model in ("reward", "critic") else None
        model_ops.load_model(
            pool,
            layout,
            name=stage,
            config=model_config(config, stage),
            optimizer=optimizer_settings(config, stage),
            full_state=full,
        )


def live_state(
    pool: DevicePool, config: NereusConfig, layouts: Mapping[ModelStage, Layout]
) -> dict[str, dict[str, torch.Tensor]]:
    """Every model's full state as the devices hold it now, by model."""
    return {
        model: gather_state(
            pool, layouts[stage], name=stage, config=model_config(config, stage), train=stage.trains
        )
        for model, stage in state_stages(layouts).items()
    }


def digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def live_digests(
    pool: DevicePool, config: NereusConfig, layouts: Mapping[ModelStage, Layout]
) -> dict[str, str]:
    """One digest per model of its live state (see the module docstring)."""
    return {model: digest(state) for model, state in live_state(pool, config, layouts).items()}


@task(cache_policy=NO_CACHE)  # no retries: a failed write leaves the previous checkpoint in force
def checkpoint(
    pool: DevicePool,
    run_dir: str,
    state: JobState,
    step: int,
    *,
    digests: bool,
    known_digests: Mapping[str, str] | None = None,
) -> float:
    """Snapshot every model's whole state as ``step`` (the state that generates rollout ``step``),
    then write the checkpoint record that makes it a resume point; returns seconds. With
    ``digests`` the record also holds every model's live digest (what resume verifies against):
    ``known_digests`` when the caller read them from live memory just before, else read here."""
    return _checkpoint(pool, run_dir, state, step, digests=digests, known_digests=known_digests)


@dataclass(frozen=True)
class StagedCheckpoint:
    """A checkpoint of ``step`` staged in host memory and written in the background; its record is
    written (it becomes a resume point) only by ``finish_checkpoint``, once every snapshot is."""

    step: int
    record: dict[str, Any]
    snapshots: tuple[StagedSnapshot, ...]


def stage_checkpoint(
    pool: DevicePool,
    run_dir: str,
    state: JobState,
    step: int,
    *,
    known_digests: Mapping[str, str] | None,
    in_place: frozenset[str] = frozenset(),
) -> StagedCheckpoint:
    """Every model's whole state as ``step`` copied to host memory on its devices, its write begun
    (``tasks.snapshots.stage_snapshot``); the record holds ``known_digests`` when given. ``in_place``:
    the model-stages whose shards are never written again, written without a copy."""
    incarnation = RunDir(run_dir).identity().incarnation
    staged = tuple(
        stage_snapshot(pool, run_dir, model, step, *rest, incarnation=incarnation, in_place=stage in in_place)
        for model, *rest in _snapshot_args(state)
        for stage in [rest[2]]  # the model-stage that holds the model's state
    )
    record = _record(state)
    if known_digests is not None:
        record["live_digests"] = dict(known_digests)
    return StagedCheckpoint(step, record, staged)


def finish_checkpoint(pool: DevicePool, run_dir: str, staged: StagedCheckpoint) -> float:
    """Wait for ``staged``'s writes, commit each snapshot and write the checkpoint record; returns
    the seconds waited. A write that failed raises; what the others wrote stays uncommitted."""
    start = time.perf_counter()
    try:
        for snapshot in staged.snapshots:
            finish_snapshot(pool, run_dir, snapshot)
    except BaseException:
        for snapshot in staged.snapshots:
            drop_snapshot(pool, snapshot)
        raise
    RunDir(run_dir).write_checkpoint(staged.step, staged.record)
    return time.perf_counter() - start


@contextmanager
def disk_filled_if_armed(run_dir: str) -> Iterator[None]:
    """The ``fill-disk:switch`` fault point: the run's file system really full inside the block."""
    if not faults.armed("fill-disk:switch"):
        yield
        return
    filler = Path(run_dir) / ".fill"
    get_run_logger().warning("fault injection: filling the file system of %s", run_dir)
    try:
        with open(filler, "wb") as out:
            while True:
                out.write(b"\0" * (1 << 20))
                out.flush()
                os.fsync(out.fileno())
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
    try:
        yield
    finally:
        filler.unlink(missing_ok=True)


def _snapshot_args(state: JobState) -> Iterator[tuple[Any, ...]]:
    """Per model, what its snapshot is written with: (model, layout, model config, model-stage,
    optimizer settings) of the model-stage that holds its state."""
    for model, stage in state_stages(state.layouts).items():
        config = model_config(state.config, stage)
        yield model, state.layouts[stage], config, stage, optimizer_settings(state.config, stage)


def _record(state: JobState) -> dict[str, Any]:
    return {
        "plan_id": state.plan_id,
        "plan": layouts_json(state.layouts),
        "devices": state.devices,
        "response_len": state.config.job.response_len,
    }


def _checkpoint(
    pool: DevicePool,
    run_dir: str,
    state: JobState,
    step: int,
    *,
    digests: bool,
    known_digests: Mapping[str, str] | None = None,
) -> float:
    run, start = RunDir(run_dir), time.perf_counter()
    incarnation = run.identity().incarnation  # a partial checkpoint of a dead driver is never reused
    for model, *rest in _snapshot_args(state):
        snapshot_model.fn(pool, run_dir, model, step, *rest, incarnation=incarnation)
    record = _record(state)
    if digests:
        live = known_digests if known_digests is not None else live_digests(pool, state.config, state.layouts)
        record["live_digests"] = dict(live)
    run.write_checkpoint(step, record)
    return time.perf_counter() - start


def held_bytes(pool: DevicePool) -> dict[int, int]:
    """Bytes of model state each device slot holds now (``nereus_core.engine.memory``); the pool keeps
    them, to name a worker lost later with its last measured memory."""
    held = dict(enumerate(pool.run_on(range(pool.size), device_held_bytes)))
    pool.note_memory(held)
    return held


def probe(
    pool: DevicePool, config: NereusConfig, layouts: Mapping[ModelStage, Layout]
) -> dict[str, torch.Tensor]:
    """The ``PROBED`` stages' outputs on a fixed batch, for those the plan has (the verification's inputs)."""
    prompts = make_prompts(config.job.task_settings, 8, seed=12345, step=0)
    gen = torch.Generator().manual_seed(12345)
    responses = torch.randint(1, config.model.vocab_size, (8, config.job.response_len), generator=gen)
    ids = torch.cat([prompts, responses], dim=1)
    return {s: model_ops.forward(pool, layouts[s], ids, name=s) for s in PROBED if s in layouts}


@task(cache_policy=NO_CACHE)
def verify_live_state(
    pool: DevicePool,
    config: NereusConfig,
    layouts: Mapping[ModelStage, Layout],
    expected: Mapping[str, str],
    *,
    what: str,
    probe_before: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Every model's live state digest == ``expected`` (read from live memory before), and the probe's
    outputs == ``probe_before`` within 1e-5 when given. Raises naming the first model that differs."""
    now = live_digests(pool, config, layouts)
    differ = sorted(m for m in expected if now.get(m) != expected[m])
    if differ or set(now) != set(expected):
        raise RuntimeError(f"{what}: the live state of {differ or sorted(set(now) ^ set(expected))} changed")
    out: dict[str, Any] = {"verified_bitwise": True}
    if probe_before is not None:
        after = probe(pool, config, layouts)
        diff = max((after[s] - probe_before[s]).abs().max().item() for s in after)
        if diff > 1e-5:
            raise RuntimeError(f"{what}: the probe's outputs moved by {diff:.2e} > 1e-5")
        out["verified_max_diff"] = diff
    get_run_logger().info("verified (%s): every model's live state bitwise equal to before", what)
    return out
