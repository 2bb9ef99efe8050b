"""Which checkpoints a run directory keeps: the newest complete ones, and nothing half-written.

A checkpoint at step N is its record ``state/checkpoints/step=N.json`` together with one snapshot
per model of its plan, ``state/<model>/step=N/``, each stamped with the record's run id and
incarnation. Snapshots are never shared between steps: every checkpoint writes every model whole,
frozen ones (reference, reward) included, so deleting the directories of step N never touches a
file another checkpoint reads.

- ``complete_checkpoints``: the steps whose record is valid, of this run, and whose every snapshot
  is committed by the record's writer. A snapshot directory without a record (a write that
  failed, or a driver that died before its record) is never counted.
- ``prune_checkpoints``: keep the newest ``keep`` complete checkpoints; delete the older ones, the
  record first (from then on no resume can pick it), then its snapshots, each uncommitted (its
  manifest removed) before its files go. Snapshot directories older than the newest complete
  checkpoint that no record names (a failed write's leftovers, a durable switch's intermediate
  snapshots) are deleted too. A crash at any point leaves every kept checkpoint whole.
- ``discard_partial``: before a checkpoint is written again at a step with no record, the snapshots
  a failed attempt committed there are removed, so the retry writes every model afresh.

Records of another run id (a run that used the directory before) and damaged records are left as
they are, with the snapshots at their steps. Boundary: files under ``<run_dir>/state``
(storage/FORMAT.md); when to prune is the job's decision.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from nereus_core.plan import state_stages
from storage.manifest import MANIFEST, fsync_dir, load_manifest, parse_step, step_dir
from storage.run_dir import RunDir, RunDirError

PathLike = str | os.PathLike[str]
CHECKPOINTS = "checkpoints"  # state/checkpoints/ holds the records, not a model's snapshots


def complete_checkpoints(run_dir: PathLike) -> list[int]:
    """Steps of this run's complete checkpoints, oldest first (see the module doc)."""
    run = RunDir(run_dir)
    steps = run.checkpoint_steps()
    if not steps:
        return []
    run_id = run.identity().run_id
    return [step for step in steps if _complete(run, step, run_id)]


def has_checkpoint(run_dir: PathLike, step: int) -> bool:
    """Whether a valid checkpoint record of this run is at ``step`` (one of a run that used the
    directory before is not: the new run writes its own there)."""
    run = RunDir(run_dir)
    if not run.checkpoint_path(step).exists():
        return False
    try:
        return run.read_checkpoint(step)["run_id"] == run.identity().run_id
    except RunDirError:
        return False


def _complete(run: RunDir, step: int, run_id: str) -> bool:
    try:
        record = run.read_checkpoint(step)
        if record["run_id"] != run_id:
            return False
        for model in state_stages(record["plan"]):
            manifest = load_manifest(step_dir(run.root, model, step))
            writer = (manifest.run_id, manifest.incarnation) if manifest else None
            if writer != (record["run_id"], record["incarnation"]):
                return False
    except (RunDirError, ValueError):  # a damaged record or manifest: not a checkpoint to count
        return False
    return True


def prune_checkpoints(run_dir: PathLike, keep: int) -> list[int]:
    """Delete every complete checkpoint but the newest ``keep`` (0: keep all, delete nothing) and the
    snapshot directories older than the newest complete checkpoint that no record names; returns the
    steps of the checkpoints deleted, oldest first."""
    if keep <= 0:
        return []
    run = RunDir(run_dir)
    complete = complete_checkpoints(run_dir)
    if not complete:
        return []
    dropped = complete[:-keep]
    for step in dropped:
        path = run.checkpoint_path(step)
        path.unlink(missing_ok=True)  # first: from here on no resume picks this step
        fsync_dir(path.parent)
        for directory in _snapshot_dirs(run.root, step.__eq__):
            _remove_snapshot(directory)
    recorded = set(run.checkpoint_steps())
    for directory in _snapshot_dirs(run.root, lambda s: s < complete[-1] and s not in recorded):
        _remove_snapshot(directory)
    return dropped


def discard_partial(run_dir: PathLike, step: int, models: Iterable[str]) -> list[Path]:
    """Remove ``models``' snapshots at ``step`` when no checkpoint record of this run is there (what a
    failed attempt left); returns the directories removed. With one there, nothing is touched."""
    run = RunDir(run_dir)
    if has_checkpoint(run_dir, step):
        return []
    removed = []
    for model in models:
        directory = step_dir(run.root, model, step)
        if directory.exists():
            _remove_snapshot(directory)
            removed.append(directory)
    return removed


def _snapshot_dirs(root: Path, wanted: Callable[[int], bool]) -> list[Path]:
    """``state/<model>/step=<N>`` directories whose step ``wanted(N)`` accepts, for every model."""
    state = root / "state"
    if not state.is_dir():
        return []
    found = []
    for model in sorted(p for p in state.iterdir() if p.is_dir() and p.name != CHECKPOINTS):
        for directory in sorted(model.iterdir()):
            step = parse_step(directory.name)
            if step is not None and directory.is_dir() and wanted(step):
                found.append(directory)
    return found


def _remove_snapshot(directory: Path) -> None:
    """Uncommit the snapshot (its manifest removed, durably), then delete its files. A directory that
    is a link (moved to another disk) loses its files and the link; the target folder stays."""
    (directory / MANIFEST).unlink(missing_ok=True)
    fsync_dir(directory)
    if directory.is_symlink():
        for entry in directory.iterdir():
            if entry.is_file() or entry.is_symlink():
                entry.unlink(missing_ok=True)
        directory.unlink()
    else:
        shutil.rmtree(directory)
    fsync_dir(directory.parent)
