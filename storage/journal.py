"""The transition journal: an append-only record of every operation, before and after it runs.

One JSON object per line in ``<run_dir>/journal/<transition_id>.jsonl``, each line
flushed and fsynced before the operation it announces starts (or after it
ends), so after a crash the journal tells exactly which operations finished
(a ``done`` line), which may have half-run (``start`` without ``done``: redo,
every operation is idempotent) and whether the plan switch committed. A torn
last line (the crash hit mid-write) is ignored: its operation had not started.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

START, DONE, FAILED, COMMIT, ABORT = "start", "done", "failed", "commit", "abort"


class Journal:
    """Append-only JSONL journal of one transition."""

    def __init__(self, run_dir: str | os.PathLike[str], transition_id: str) -> None:
        self.path = Path(run_dir) / "journal" / f"{transition_id}.jsonl"
        self.transition_id = transition_id

    def record(self, op_id: str, phase: str, **details: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"op": op_id, "phase": phase, "t": time.time(), **details}, sort_keys=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line: that write never completed
        return out

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
