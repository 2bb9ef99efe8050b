"""EMU snapshots: write a model's shards at a step, list the committed ones, read slices or full state back.

Data flow of the durable path: every device writes its slices (``write_shard_file``, one
Arrow file per device), one caller commits the manifest (``commit_snapshot``); after a
layout change each new rank asks ``read_slices(ref, new_map.wanted(device))`` and gets
exactly its boxes, read only from the record batches that intersect them.
``write_snapshot`` does both steps in one process. ``read_full_state`` is the design's
contract: full parameters with Hugging Face names.

Identity: a writer given the driver's ``incarnation`` stamps the manifest with it and the run
id (run.json). A committed snapshot is immutable while it belongs to a checkpoint record of the
same run and incarnation, or to the writing driver itself; any other one at that step is the
leftover of a driver that died before its checkpoint record (a partial checkpoint) or of a run
that once used the directory: the next writer removes its manifest first and writes anew, so
it is never mixed into the new checkpoint. Readers given an ``incarnation`` see only snapshots
of this run written by that incarnation.

Boundary: files under ``<run_dir>/state`` (storage/FORMAT.md). Slices are described by
``nereus_core.emu`` types (``SliceSpec``, ``Box``); which slices a rank needs is the shard
map's business, not the store's. No pickle: data files are Arrow IPC, manifests JSON. Every
tensor is stored as its raw bytes with its torch dtype recorded (Arrow has no bf16), so bf16
weights and their fp32 masters come back bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nereus_core.emu import Box, SliceSpec, split_state_name
from nereus_core.layout import Layout
from storage.ipc import DTYPES, SliceReader, write_slices
from storage.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    SliceEntry,
    SnapshotError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    commit_manifest,
    fsync_dir,
    load_manifest,
    make_dirs,
    parse_step,
    state_dir,
    step_dir,
)
from storage.run_dir import RunDir, RunIdentity

PathLike = str | os.PathLike[str]
Slices = Mapping[str, tuple[torch.Tensor, SliceSpec]] | Iterable[tuple[str, torch.Tensor, SliceSpec]]


@dataclass(frozen=True)
class SnapshotRef:
    """A committed snapshot: its directory and manifest."""

    path: Path
    manifest: Manifest

    @property
    def model(self) -> str:
        return self.manifest.model

    @property
    def step(self) -> int:
        return self.manifest.step

    def names(self) -> list[str]:
        """Tensor names in the snapshot, in first-written order."""
        return list(dict.fromkeys(s.name for f in self.manifest.files for s in f.slices))


def _as_triples(slices: Slices) -> list[tuple[str, torch.Tensor, SliceSpec]]:
    if isinstance(slices, Mapping):
        return [(name, tensor, spec) for name, (tensor, spec) in slices.items()]
    return list(slices)


def _identity(run_dir: PathLike, incarnation: int | None) -> RunIdentity | None:
    """The writer's identity: this run's id with the driver's ``incarnation`` (None: not stamped)."""
    if incarnation is None:
        return None
    return RunIdentity(RunDir(run_dir).identity().run_id, incarnation)


def _written_by(manifest: Manifest, who: RunIdentity) -> bool:
    return (manifest.run_id, manifest.incarnation) == (who.run_id, who.incarnation)


def _in_checkpoint(run_dir: PathLike, manifest: Manifest) -> bool:
    """Whether ``manifest``'s snapshot belongs to a checkpoint record of the same run and incarnation."""
    run = RunDir(run_dir)
    if manifest.run_id is None or not run.checkpoint_path(manifest.step).exists():
        return False
    record = run.read_checkpoint(manifest.step)
    return (record["run_id"], record["incarnation"]) == (manifest.run_id, manifest.incarnation)


def _refuse_committed(run_dir: PathLike, directory: Path, who: RunIdentity | None) -> None:
    """Refuse to rewrite a committed snapshot; but a stale one (see the module doc) is uncommitted:
    its manifest removed (durably) before any new file lands beside it."""
    manifest = load_manifest(directory)
    if manifest is None:
        return
    if who is None or _written_by(manifest, who) or _in_checkpoint(run_dir, manifest):
        raise SnapshotExistsError(f"{directory}: already committed; a snapshot is never rewritten")
    (directory / MANIFEST).unlink(missing_ok=True)  # several devices may race here: all agree
    fsync_dir(directory)


def write_shard_file(
    run_dir: PathLike,
    model: str,
    step: int,
    device: int,
    slices: Slices,
    *,
    incarnation: int | None = None,
) -> FileEntry:
    """Write ``device``'s slices of ``model`` at ``step`` (not yet visible: commit the snapshot next).
    ``incarnation`` (the writing driver's) lets it replace a stale snapshot at that step."""
    directory = step_dir(run_dir, model, step)
    make_dirs(directory)
    _refuse_committed(run_dir, directory, _identity(run_dir, incarnation))
    path = directory / f"device={device}.arrow"
    entries = write_slices(path, _as_triples(slices))
    return FileEntry(path=path.name, device=device, size=path.stat().st_size, slices=tuple(entries))


def commit_snapshot(
    run_dir: PathLike,
    model: str,
    step: int,
    files: Sequence[FileEntry],
    *,
    layout: Layout | None = None,
    meta: Mapping[str, Any] | None = None,
    incarnation: int | None = None,
) -> SnapshotRef:
    """Make the snapshot visible: fsync its directory, then commit its manifest atomically, stamped
    with the run id and ``incarnation`` when given (the same the shard files were written with)."""
    directory = step_dir(run_dir, model, step)
    who = _identity(run_dir, incarnation)
    _refuse_committed(run_dir, directory, who)
    for entry in files:
        if not (directory / entry.path).is_file():
            raise SnapshotError(
                f"{directory / entry.path}: missing; write every shard file before committing"
            )
    fsync_dir(directory)
    manifest = Manifest(
        model=model,
        step=step,
        layout=layout,
        files=tuple(files),
        meta=dict(meta or {}),
        run_id=who.run_id if who else None,
        incarnation=who.incarnation if who else None,
    )
    commit_manifest(directory, manifest)
    _drop_unlisted(directory, manifest)
    return SnapshotRef(directory, manifest)


def _drop_unlisted(directory: Path, manifest: Manifest) -> None:
    """Data files a stale snapshot left that the committed one does not list (never read; space)."""
    listed = {f.path for f in manifest.files}
    for path in directory.glob("device=*.arrow"):
        if path.name not in listed:
            path.unlink(missing_ok=True)


def write_snapshot(
    run_dir: PathLike,
    model: str,
    step: int,
    shards: Mapping[int, Slices],
    *,
    layout: Layout | None = None,
    meta: Mapping[str, Any] | None = None,
    incarnation: int | None = None,
) -> SnapshotRef:
    """Write one file per device (``shards[device]``: name -> (tensor, SliceSpec)) and commit them."""
    files = [
        write_shard_file(run_dir, model, step, device, slices, incarnation=incarnation)
        for device, slices in shards.items()
    ]
    return commit_snapshot(run_dir, model, step, files, layout=layout, meta=meta, incarnation=incarnation)


def list_snapshots(run_dir: PathLike, model: str, *, incarnation: int | None = None) -> list[SnapshotRef]:
    """Committed snapshots of ``model``, oldest step first; uncommitted directories are invisible.
    With ``incarnation``: only those this run's driver of that incarnation wrote."""
    root = state_dir(run_dir, model)
    if not root.is_dir():
        return []
    who = _identity(run_dir, incarnation)
    steps = sorted(
        (step, p) for p in root.iterdir() if p.is_dir() and (step := parse_step(p.name)) is not None
    )
    refs = []
    for _, directory in steps:
        manifest = load_manifest(directory)
        if manifest is not None and (who is None or _written_by(manifest, who)):
            refs.append(SnapshotRef(directory, manifest))
    return refs


def find_snapshot(
    run_dir: PathLike, model: str, step: int | None = None, *, incarnation: int | None = None
) -> SnapshotRef:
    """The committed snapshot of ``model`` at ``step``, or the latest one if ``step`` is None; with
    ``incarnation``, only one written by this run's driver of that incarnation (a checkpoint's
    snapshots: pass the checkpoint record's ``incarnation``)."""
    refs = list_snapshots(run_dir, model, incarnation=incarnation)
    chosen = refs[-1:] if step is None else [r for r in refs if r.step == step]
    if not chosen:
        at = "" if step is None else f" at step {step}"
        by = "" if incarnation is None else f" written by incarnation {incarnation}"
        have = ", ".join(str(r.step) for r in refs) or "none"
        raise SnapshotNotFoundError(f"{model} has no snapshot{at}{by}; committed steps: {have}")
    return chosen[0]


class _Readers:
    """Data files of one snapshot, each opened (and size-checked) at most once."""

    def __init__(self, ref: SnapshotRef) -> None:
        self.ref = ref
        self.open: dict[str, SliceReader] = {}

    def view(self, file: FileEntry, entry: SliceEntry) -> torch.Tensor:
        reader = self.open.get(file.path)
        if reader is None:
            reader = self.open[file.path] = SliceReader(self.ref.path / file.path, file.size)
        return reader.view(entry)

    def close(self) -> None:
        for reader in self.open.values():
            reader.close()


def _stored_box(entry: SliceEntry) -> Box:
    return Box(entry.start, tuple(a + n for a, n in zip(entry.start, entry.shape, strict=True)))


def _assemble(
    readers: _Readers, name: str, box: Box | None, stored: list[tuple[FileEntry, SliceEntry]]
) -> torch.Tensor:
    """The ``box`` of ``name`` copied out of the stored slices that intersect it (only those are read)."""
    if not stored:
        raise SnapshotError(f"{readers.ref.path}: no tensor {name!r} in this snapshot")
    global_shape, dtype = stored[0][1].global_shape, DTYPES[stored[0][1].dtype]
    box = Box.full(global_shape) if box is None else box
    if not Box.full(global_shape).contains(box):
        raise SnapshotError(f"{name}: wanted box {box} lies outside its global shape {global_shape}")
    out = torch.empty(box.shape, dtype=dtype)
    remaining = [box] if box.numel else []
    for file, entry in stored:
        have = _stored_box(entry)
        hits = [inter for r in remaining if (inter := r.intersect(have)) is not None]
        if not hits:
            continue
        view = readers.view(file, entry)
        for inter in hits:
            out[inter.relative_to(box).slices()] = view[inter.relative_to(have).slices()]
        remaining = [part for r in remaining for part in r.subtract(have)]
        if not remaining:
            break
    if remaining:
        raise SnapshotError(
            f"{readers.ref.path}: {name} region {remaining[0]} is in none of its stored slices"
        )
    return out


def read_slices(ref: SnapshotRef, wanted: Sequence[tuple[str, Box | None]]) -> list[torch.Tensor]:
    """Fresh tensors of the ``(name, box)`` regions asked for (``None``: the whole tensor), in order."""
    stored: dict[str, list[tuple[FileEntry, SliceEntry]]] = {}
    for file in ref.manifest.files:
        for entry in file.slices:
            stored.setdefault(entry.name, []).append((file, entry))
    readers = _Readers(ref)
    try:
        return [_assemble(readers, name, box, stored.get(name, [])) for name, box in wanted]
    finally:
        readers.close()


def read_full_state(
    run_dir: PathLike, model: str, step: int | None = None, *, optimizer: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters of ``model`` with Hugging Face names, at ``step`` or the latest,
    in the dtype they were written in (bf16 for ``model.dtype: bf16``); ``optimizer=True`` adds what
    a train stage's snapshot holds besides: ``<param>:exp_avg``, ``<param>:exp_avg_sq``, the fp32
    master weights ``<param>:master`` of a bf16 model, and the AdamW step count."""
    ref = find_snapshot(run_dir, model, step)
    names = [n for n in ref.names() if optimizer or split_state_name(n)[1] == "param"]
    return dict(zip(names, read_slices(ref, [(n, None) for n in names]), strict=True))
