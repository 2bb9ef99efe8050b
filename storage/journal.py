"""The transition journal: an append-only record of every operation, before and after it runs.

One JSON object per line in ``<run_dir>/journal/<transition_id>.jsonl``, each line
flushed and fsynced before the operation it announces starts (or after it
ends), so after a crash the journal tells exactly which operations finished
(a ``done`` line), which may have half-run (``start`` without ``done``: redo,
every operation is idempotent) and whether the plan switch committed.

A torn last line (the crash hit mid-write, or a full disk took half a line) is a
record that never completed: its operation had not started. Readers ignore it; the
next writer cuts the file back to its last complete line (truncate, fsync) before
appending, so a record written after it never glues onto it. Readers do not cut:
a reader cannot tell a crashed writer from one in the middle of its write. A line
glued by an older writer (a torn record followed by a whole one on one line) is read
as the whole record it ends with. Any other unreadable line is damage: ``RunDirError``
naming the file and line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from storage.errors import RunDirError
from storage.manifest import fsync_dir

START, DONE, FAILED, COMMIT, ABORT = "start", "done", "failed", "commit", "abort"
_CHUNK = 4096


def _last_newline_end(fd: int, size: int) -> int:
    """The length of the file's complete lines: one past its last newline (0 if it has none)."""
    end = size
    while end > 0:
        begin = max(0, end - _CHUNK)
        found = os.pread(fd, end - begin, begin).rfind(b"\n")
        if found >= 0:
            return begin + found + 1
        end = begin
    return 0


def cut_torn_tail(fd: int) -> int:
    """Truncate the file open as ``fd`` to its last complete line and fsync it; returns the bytes cut."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return 0
    keep = _last_newline_end(fd, size)
    os.ftruncate(fd, keep)
    os.fsync(fd)
    return size - keep


def _glued_record(line: str) -> Any:
    """The whole record a line ends with when a torn record was glued in front of it, or raise."""
    at = line.find('{"', 1)
    while at > 0:
        try:
            return json.loads(line[at:])
        except json.JSONDecodeError:
            at = line.find('{"', at + 1)
    raise json.JSONDecodeError("not a JSON record", line, 0)


class Journal:
    """Append-only JSONL journal of one transition."""

    def __init__(self, run_dir: str | os.PathLike[str], transition_id: str) -> None:
        self.path = Path(run_dir) / "journal" / f"{transition_id}.jsonl"
        self.transition_id = transition_id

    def record(self, op_id: str, phase: str, **details: Any) -> None:
        """Append one record, durably, after cutting a torn last line left by a crash or a full disk."""
        line = json.dumps({"op": op_id, "phase": phase, "t": time.time(), **details}, sort_keys=True)
        data = (line + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            cut_torn_tail(fd)
            while data:  # a short write is retried; if it raises, the next record cuts the rest
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            fsync_dir(self.path.parent)  # the new file's name survives a crash too

    def entries(self) -> list[dict[str, Any]]:
        """Every complete record, oldest first; a torn last line is left out (see the module doc)."""
        try:
            text = self.path.read_bytes().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return []
        lines = text.split("\n")[:-1]  # the part after the last newline is torn or empty
        return [e for number, line in enumerate(lines, 1) if (e := self._parse(number, line)) is not None]

    def _parse(self, number: int, line: str) -> dict[str, Any] | None:
        if not line.strip():
            return None
        try:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                entry = _glued_record(line)
        except json.JSONDecodeError:
            raise RunDirError(
                f"{self.path}: line {number} is not a JSON record; the journal is damaged"
            ) from None
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("op", "phase")):
            raise RunDirError(f"{self.path}: line {number} is not a journal record (no 'op' and 'phase')")
        return entry

    def done_ops(self) -> set[str]:
        return {e["op"] for e in self.entries() if e["phase"] == DONE}

    def status(self) -> str:
        """``committed``, ``aborted``, ``interrupted`` (started, not ended) or ``empty``."""
        phases = [e["phase"] for e in self.entries() if e["op"] == "transition"]
        if COMMIT in phases:
            return "committed"
        if ABORT in phases:
            return "aborted"
        return "interrupted" if self.entries() else "empty"

    def header(self) -> Mapping[str, Any] | None:
        """The transition's own start record (plans, reason), if written."""
        for e in self.entries():
            if e["op"] == "transition" and e["phase"] == START:
                return e
        return None


def journals(run_dir: str | os.PathLike[str]) -> list[Journal]:
    """Every transition journal of a run, oldest first."""
    root = Path(run_dir) / "journal"
    if not root.is_dir():
        return []
    paths = sorted(root.glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    return [Journal(run_dir, p.stem) for p in paths]
