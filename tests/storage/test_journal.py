"""The transition journal (storage/journal.py): a torn last line is cut back, every later record reads."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import storage.journal
from storage.errors import RunDirError
from storage.journal import COMMIT, DONE, START, Journal

PLAN = {"actor/train": {"tp": 1, "pp": 2, "dp": 1, "devices": [0, 1]}}


def _interrupted(tmp_path: Path) -> Journal:
    journal = Journal(tmp_path, "t001-step4")
    journal.record("transition", START, checkpoint_step=4, old=PLAN, new=PLAN)
    journal.record("move:actor/train", START)
    journal.record("move:actor/train", DONE, bytes=128)
    return journal


def _tear_last_line(journal: Journal, keep: int) -> bytes:
    """Cut the file inside its last line, as a crash mid-write leaves it; returns the torn bytes."""
    blob = journal.path.read_bytes()
    begin = blob.rstrip(b"\n").rfind(b"\n") + 1
    os.truncate(journal.path, begin + keep)
    return blob[begin : begin + keep]


def test_a_record_after_a_torn_line_is_readable_and_commits(tmp_path: Path) -> None:
    journal = _interrupted(tmp_path)
    torn = _tear_last_line(journal, keep=20)
    assert torn.startswith(b"{") and not torn.endswith(b"\n")
    assert journal.done_ops() == set()  # the torn `done` never completed
    assert journal.status() == "interrupted"

    resumed = Journal(tmp_path, "t001-step4")  # what `nereus resume` opens
    resumed.record("transition", COMMIT, finished_by="resume")
    assert resumed.status() == "committed"
    assert [(e["op"], e["phase"]) for e in resumed.entries()] == [
        ("transition", START),
        ("move:actor/train", START),
        ("transition", COMMIT),
    ]
    lines = journal.path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1])  # torn bytes are gone
    resumed.record("move:actor/train", DONE)
    assert resumed.done_ops() == {"move:actor/train"}


def test_a_torn_first_line_is_cut_to_an_empty_file(tmp_path: Path) -> None:
    journal = Journal(tmp_path, "t000-step0")
    journal.path.parent.mkdir()
    journal.path.write_bytes(b'{"op": "transition", "pha')
    assert journal.entries() == [] and journal.status() == "empty"
    journal.record("transition", START, step=0)
    assert [e["op"] for e in journal.entries()] == ["transition"]
    assert journal.path.read_bytes().count(b"\n") == 1


def test_readers_leave_a_torn_tail_to_the_writer(tmp_path: Path) -> None:
    journal = _interrupted(tmp_path)
    _tear_last_line(journal, keep=5)
    size = journal.path.stat().st_size
    assert len(journal.entries()) == 2 and journal.header() is not None
    assert journal.path.stat().st_size == size  # a live writer may be mid-line: readers never cut


def test_a_write_cut_short_by_a_full_disk_is_cut_back_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = _interrupted(tmp_path)
    real_write = os.write

    def half_then_full(fd: int, data: bytes) -> int:
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.journal.os, "write", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        journal.record("transition", COMMIT)
    monkeypatch.undo()
    assert journal.status() == "interrupted"
    journal.record("transition", COMMIT)
    assert journal.status() == "committed" and len(journal.entries()) == 4


def test_a_line_glued_by_an_older_writer_reads_as_its_whole_record(tmp_path: Path) -> None:
    journal = _interrupted(tmp_path)
    torn = _tear_last_line(journal, keep=17)
    whole = json.dumps({"op": "transition", "phase": COMMIT, "new": PLAN, "t": 1.0}, sort_keys=True)
    with open(journal.path, "ab") as handle:  # what appending without cutting back did
        handle.write(whole.encode() + b"\n")
    assert torn in journal.path.read_bytes()
    assert journal.status() == "committed"
    assert journal.entries()[-1]["new"] == PLAN


def test_a_damaged_line_names_the_file_and_line(tmp_path: Path) -> None:
    journal = _interrupted(tmp_path)
    blob = journal.path.read_bytes().split(b"\n")
    blob[1] = b"not json at all"
    journal.path.write_bytes(b"\n".join(blob))
    with pytest.raises(RunDirError, match=r"t001-step4\.jsonl: line 2 is not a JSON record") as err:
        journal.status()
    assert "\n" not in str(err.value)
    blob[1] = b'{"phase": "start"}'
    journal.path.write_bytes(b"\n".join(blob))
    with pytest.raises(RunDirError, match=r"line 2 is not a journal record"):
        journal.done_ops()
