"""Nereus storage: the Arrow-backed EMU store and the run's metrics tables.

It imports pyarrow and nereus_core types, never prefect or dask. The run
directory it writes is documented field by field in storage/FORMAT.md.
"""

from storage.errors import RunDirError
from storage.lock import RunLocked, lock_holder, run_lock
from storage.manifest import (
    CorruptSnapshotError,
    FileEntry,
    Manifest,
    SliceEntry,
    SnapshotError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    state_dir,
    step_dir,
)
from storage.snapshot import (
    SnapshotRef,
    commit_snapshot,
    find_snapshot,
    list_snapshots,
    read_full_state,
    read_slices,
    write_shard_file,
    write_snapshot,
)

__all__ = [
    "CorruptSnapshotError",
    "FileEntry",
    "Manifest",
    "RunDirError",
    "RunLocked",
    "SliceEntry",
    "SnapshotError",
    "SnapshotExistsError",
    "SnapshotNotFoundError",
    "SnapshotRef",
    "commit_snapshot",
    "find_snapshot",
    "list_snapshots",
    "lock_holder",
    "read_full_state",
    "read_slices",
    "run_lock",
    "state_dir",
    "step_dir",
    "write_shard_file",
    "write_snapshot",
]
