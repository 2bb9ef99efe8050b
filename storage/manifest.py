"""Snapshot manifests: where snapshots live under a run directory and the commit that makes one visible.

A snapshot of a model at a step is the directory ``<run_dir>/state/<model>/step=<N>/``
holding one Arrow data file per device and ``manifest.json``. It exists once, and only
once, its manifest is committed: written under a temporary name in the same directory,
flushed and fsynced, renamed over ``manifest.json`` with ``os.replace`` (atomic on POSIX),
and the directory fsynced so the rename survives a crash. Data files are fsynced before
the manifest is written, so a committed manifest never names a file that is not on disk.

A manifest is input like any other file of a run directory: every data file it names must
resolve (symlinks followed) inside the run directory, and its model and step must be those of
its directory, or it is refused. Since format version 2 it also carries the identity of the
driver that wrote it (``run_id``, ``incarnation``), so that a partial checkpoint of a dead
driver is told apart from the current driver's work (storage/snapshot.py).

Boundary: paths, JSON and fsync. Nothing here reads Arrow or tensors (storage/ipc.py does).
Field by field: storage/FORMAT.md.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from nereus_core.frozen import Frozen
from nereus_core.layout import Layout
from storage.errors import RunDirError

MANIFEST = "manifest.json"
FORMAT = "nereus-emu-snapshot"
_MODEL_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_STEP_RE = re.compile(r"^step=(\d+)$")


class SnapshotError(RuntimeError):
    """A snapshot cannot be written or read as asked; the message names the file and the tensor."""


class CorruptSnapshotError(SnapshotError, RunDirError):
    """A committed snapshot's bytes do not match its manifest (crc, size, or unreadable Arrow)."""


class SnapshotExistsError(SnapshotError, FileExistsError):
    """A committed snapshot already exists at that step; snapshots are immutable once committed."""


class SnapshotNotFoundError(SnapshotError, RunDirError, LookupError):
    """No committed snapshot matches the request; the message lists the committed steps."""


class SliceEntry(Frozen):
    """One tensor slice: one record batch of a data file."""

    name: str = Field(min_length=1, description="Tensor name: HF parameter name, '<param>:exp_avg', ...")
    batch: int = Field(ge=0, description="Index of the record batch in its file.")
    global_shape: tuple[int, ...] = Field(description="Shape of the whole (unsharded) tensor.")
    start: tuple[int, ...] = Field(description="Offset of the slice in the global tensor, per dim.")
    shape: tuple[int, ...] = Field(description="Shape of the slice.")
    dtype: str = Field(description="torch dtype name without 'torch.', e.g. 'float32', 'bfloat16'.")
    crc32: int = Field(ge=0, lt=2**32, description="zlib.crc32 of the raw bytes of the slice.")
    nbytes: int = Field(ge=0, description="Length of the raw bytes.")


class FileEntry(Frozen):
    """One Arrow IPC data file of a snapshot (one per device)."""

    path: str = Field(description="File name, relative to the snapshot directory.")
    device: int = Field(ge=0, description="Device slot whose slices the file holds.")
    size: int = Field(ge=0, description="File size in bytes; a mismatch means truncation.")
    slices: tuple[SliceEntry, ...] = Field(description="The file's record batches, in order.")


class Manifest(Frozen):
    """The committed description of one snapshot."""

    format: Literal["nereus-emu-snapshot"] = FORMAT
    version: Literal[1, 2] = 2
    model: str = Field(description="Model name: actor, critic, reference or reward.")
    step: int = Field(ge=0, description="PPO step the state belongs to (after that step's update).")
    layout: Layout | None = Field(default=None, description="Layout the shards were taken under.")
    files: tuple[FileEntry, ...] = Field(description="Data files, in writing order.")
    meta: dict[str, Any] = Field(default_factory=dict, description="Caller's JSON extras (plan id, ...).")
    run_id: str | None = Field(default=None, description="The run's id (run.json) when written by a driver.")
    incarnation: int | None = Field(
        default=None, ge=0, description="The writing driver's incarnation (run.json): 0, +1 per resume."
    )


def check_model_name(model: str) -> str:
    if not _MODEL_RE.match(model):
        raise ValueError(f"model {model!r} is not a plain name; use e.g. 'actor' (letters, digits, '_.-')")
    return model


def state_dir(run_dir: str | os.PathLike[str], model: str) -> Path:
    """``<run_dir>/state/<model>``."""
    return Path(run_dir) / "state" / check_model_name(model)


def step_dir(run_dir: str | os.PathLike[str], model: str, step: int) -> Path:
    """``<run_dir>/state/<model>/step=<N>``."""
    if step < 0:
        raise ValueError(f"step={step} is negative; steps count from 0")
    return state_dir(run_dir, model) / f"step={step}"


def parse_step(name: str) -> int | None:
    """The step of a ``step=<N>`` directory name, or None."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """Create ``path`` (and parents) and make the new entries durable."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        fsync_dir(created.parent)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary name in ``path``'s directory to write the new file under; on leaving the block
    it is fsynced and renamed over ``path`` (``os.replace``: readers see the old file or the new
    one, never a part), or removed if the block raised."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (``replacing``), then fsync the directory."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)
    fsync_dir(path.parent)


def commit_manifest(directory: Path, manifest: Manifest) -> Path:
    """Commit ``manifest`` into the snapshot ``directory``: from here on the snapshot is visible."""
    path = directory / MANIFEST
    atomic_write(path, manifest.model_dump_json(indent=1).encode())
    return path


def _check_confined(path: Path, directory: Path, manifest: Manifest) -> None:
    """Refuse a manifest whose data files lie outside its snapshot directory (symlinks followed) or
    that belongs to another directory: ``directory`` is ``<run_dir>/state/<model>/step=<N>``. The
    directory itself may be a link (``state/`` moved to a larger disk); its files may not."""
    here = directory.resolve()
    for entry in manifest.files:
        target = (directory / entry.path).resolve()
        if target.parent != here:
            where = "its snapshot directory"
            if not target.is_relative_to(directory.parents[2].resolve()):
                where = "the run directory"
            raise RunDirError(f"{path}: path {entry.path!r} is outside {where}")
    if (directory.parent.name, directory.name) != (manifest.model, f"step={manifest.step}"):
        raise CorruptSnapshotError(
            f"{path}: describes {manifest.model} at step {manifest.step}, not its directory "
            f"{directory.parent.name}/{directory.name}"
        )


def load_manifest(directory: Path) -> Manifest | None:
    """The committed manifest of ``directory`` (``<run_dir>/state/<model>/step=<N>``), or None if there
    is none (an uncommitted snapshot). A damaged one, or one naming a file outside the run directory,
    is refused (``CorruptSnapshotError``, ``RunDirError``), naming the manifest."""
    path = directory / MANIFEST
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        manifest = Manifest.model_validate_json(text)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise CorruptSnapshotError(f"{path}: not a valid manifest ({where}: {first['msg']})") from None
    _check_confined(path, directory, manifest)
    return manifest
