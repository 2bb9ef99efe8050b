"""Run directories as hostile input (storage/run_dir.py, manifest.py, snapshot.py): damaged files,
escaping paths and a dead driver's partial checkpoint are refused in one line or never reused."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from nereus_core.emu import Box, SliceSpec
from nereus_core.layout import Layout
from storage import (
    CorruptSnapshotError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    find_snapshot,
    list_snapshots,
    read_full_state,
    write_snapshot,
)
from storage.errors import RunDirError
from storage.export import export_hf
from storage.run_dir import RunDir

PLAN = {"actor/train": Layout.contiguous(pp=2).model_dump(mode="json")}
RECORD = {"plan_id": "a", "plan": PLAN, "devices": 2, "response_len": 6}
# Nine levels of nine aliases: a few hundred bytes that expand to 9**9 values.
BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9)
)


def _one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(err.value)
    assert "\n" not in message and len(message) < 300, message
    return message


def _shards(value: float, devices: tuple[int, ...] = (0,)) -> dict[int, dict]:
    """``w`` (2 x 3) split by rows over ``devices`` (one or two), filled with ``value``."""
    rows = 2 // len(devices)
    return {
        d: {"w": (torch.full((rows, 3), value), SliceSpec((2, 3), Box((i * rows, 0), ((i + 1) * rows, 3))))}
        for i, d in enumerate(devices)
    }


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return RunDir.create(tmp_path / "run", {"name": "t"})


# -- damaged documents ---------------------------------------------------------------------------


def test_a_truncated_checkpoint_record_names_the_file(run: RunDir) -> None:
    run.write_checkpoint(5, RECORD)
    path = run.checkpoint_path(5)
    os.truncate(path, path.stat().st_size // 2)
    for read in (lambda: run.read_checkpoint(5), run.latest_checkpoint):
        with pytest.raises(RunDirError) as err:
            read()
        assert re.search(r"checkpoints/step=5\.json: not valid JSON .* truncated or damaged", _one_line(err))


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda r: r.pop("devices"), "missing key 'devices'"),
        (lambda r: r.pop("run_id"), "missing key 'run_id'"),
        (lambda r: r.update(devices="two"), "devices: Input should be a valid integer"),
        (lambda r: r.update(plan={"actor/train": {"tp": 0}}), "plan.actor/train"),
        (lambda r: r.update(step=4), "holds step 4, not 5"),
    ],
)
def test_an_edited_checkpoint_record_names_file_and_key(run: RunDir, edit, expected: str) -> None:
    run.write_checkpoint(5, RECORD)
    record = json.loads(run.checkpoint_path(5).read_text())
    edit(record)
    run.checkpoint_path(5).write_text(json.dumps(record))
    with pytest.raises(RunDirError) as err:
        run.latest_checkpoint()
    message = _one_line(err)
    assert message.startswith(f"{run.checkpoint_path(5)}: ") and expected in message


def test_a_truncated_summary_names_the_file(run: RunDir) -> None:
    run.write_summary({"status": "completed", "history": [{"step": 0}] * 50})
    path = run.root / "summary.json"
    os.truncate(path, path.stat().st_size - 30)
    with pytest.raises(RunDirError) as err:
        run.read_summary()
    assert _one_line(err).startswith(f"{path}: not valid JSON")
    path.write_text("[1, 2]")
    with pytest.raises(RunDirError, match=r"summary\.json: not a JSON object but list"):
        run.read_summary()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- a\n- b\n", "config.yaml: not a mapping but list"),
        ("just a string", "config.yaml: not a mapping but str"),
        ("a: [1, 2\n", "config.yaml: not valid YAML at line 2"),
        (BOMB, "config.yaml: refused: expands to more than"),
    ],
)
def test_a_config_that_is_not_a_mapping_is_refused(run: RunDir, text: str, expected: str) -> None:
    (run.root / "config.yaml").write_text(text)
    with pytest.raises(RunDirError) as err:
        run.read_config()
    assert expected in _one_line(err)


def test_a_directory_without_config_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match=r"x is not a run directory \(no config\.yaml\)"):
        export_hf(tmp_path / "x", model="actor", step=None, out=tmp_path / "out")


# -- missing snapshots and escaping paths ----------------------------------------------------------


def test_a_missing_step_lists_the_committed_steps(run: RunDir) -> None:
    for step in (0, 10, 20):
        write_snapshot(run.root, "actor", step, _shards(float(step)))
    with pytest.raises(SnapshotNotFoundError) as err:
        read_full_state(run.root, "actor", 7)
    assert _one_line(err) == "actor has no snapshot at step 7; committed steps: 0, 10, 20"
    assert isinstance(err.value, RunDirError) and isinstance(err.value, ValueError)
    with pytest.raises(RunDirError, match="critic has no snapshot; committed steps: none"):
        find_snapshot(run.root, "critic")


@pytest.mark.parametrize(
    ("target", "outside"),
    [
        ("/etc/hostname", "the run directory"),
        ("../../../../x", "the run directory"),
        ("../../x", "its snapshot directory"),  # state/x: in the run, not in the snapshot
        ("../step=1/device=0.arrow", "its snapshot directory"),
    ],
)
def test_a_manifest_path_outside_the_run_directory_is_refused(run: RunDir, target: str, outside: str) -> None:
    ref = write_snapshot(run.root, "actor", 0, _shards(1.0))
    write_snapshot(run.root, "actor", 1, _shards(1.0))
    manifest = json.loads((ref.path / "manifest.json").read_text())
    manifest["files"][0]["path"] = target
    (ref.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RunDirError) as err:
        read_full_state(run.root, "actor", 0)
    assert _one_line(err) == f"{ref.path / 'manifest.json'}: path {target!r} is outside {outside}"
    assert "state/actor/step=0/manifest.json: path" in str(err.value)


def test_a_data_file_linked_outside_the_run_directory_is_refused(run: RunDir, tmp_path: Path) -> None:
    ref = write_snapshot(run.root, "actor", 0, _shards(1.0))
    outside = tmp_path / "elsewhere.arrow"
    os.replace(ref.path / "device=0.arrow", outside)
    os.symlink(outside, ref.path / "device=0.arrow")
    with pytest.raises(RunDirError, match=r"path 'device=0\.arrow' is outside the run directory"):
        list_snapshots(run.root, "actor")


def test_a_state_directory_moved_to_another_disk_still_reads(run: RunDir, tmp_path: Path) -> None:
    write_snapshot(run.root, "actor", 0, _shards(2.0))
    os.replace(run.root / "state", tmp_path / "big-disk")
    os.symlink(tmp_path / "big-disk", run.root / "state")
    assert torch.equal(read_full_state(run.root, "actor", 0)["w"], torch.full((2, 3), 2.0))


def test_a_manifest_copied_from_another_step_is_refused(run: RunDir) -> None:
    write_snapshot(run.root, "actor", 0, _shards(0.0))
    ref = write_snapshot(run.root, "actor", 3, _shards(3.0))
    (ref.path.parent / "step=0" / "manifest.json").write_bytes((ref.path / "manifest.json").read_bytes())
    with pytest.raises(
        CorruptSnapshotError, match=r"describes actor at step 3, not its directory actor/step=0"
    ):
        read_full_state(run.root, "actor", 0)


# -- identity: run id and incarnation --------------------------------------------------------------


def test_run_json_holds_a_random_id_and_the_incarnation(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run", {})
    first = run.identity()
    assert re.fullmatch(r"[0-9a-f]{32}", first.run_id) and first.incarnation == 0
    assert [run.begin_incarnation(), run.begin_incarnation()] == [1, 2]
    assert RunDir(run.root).identity() == type(first)(first.run_id, 2)  # persisted
    again = RunDir.create(run.root, {})  # a new run in the same directory: a new trajectory
    assert again.identity().run_id != first.run_id and again.identity().incarnation == 0


def test_checkpoint_records_are_stamped_and_another_runs_are_not_resumed(run: RunDir) -> None:
    run.write_checkpoint(2, {**RECORD, "run_id": "forged", "incarnation": 9})
    record = run.latest_checkpoint()
    assert record is not None and record["step"] == 2
    assert (record["run_id"], record["incarnation"]) == (run.identity().run_id, 0)
    RunDir.create(run.root, {"name": "t"})  # started afresh: the old record is another run's
    assert run.checkpoint_steps() == [2] and run.latest_checkpoint() is None


def test_a_dead_drivers_partial_checkpoint_is_overwritten_not_reused(run: RunDir) -> None:
    """Incarnation 0 wrote the actor at step 10 (two devices) and died before the critic and the record."""
    write_snapshot(run.root, "actor", 10, _shards(0.0, devices=(0, 1)), incarnation=0)
    assert run.begin_incarnation() == 1
    # The new driver does not take it for its own ...
    assert list_snapshots(run.root, "actor", incarnation=1) == []
    with pytest.raises(
        SnapshotNotFoundError, match="at step 10 written by incarnation 1; committed steps: none"
    ):
        find_snapshot(run.root, "actor", 10, incarnation=1)
    # ... and writes its own over it: one device now, the dead driver's second file is gone.
    ref = write_snapshot(run.root, "actor", 10, _shards(1.0), incarnation=1)
    assert (ref.manifest.run_id, ref.manifest.incarnation) == (run.identity().run_id, 1)
    assert sorted(p.name for p in ref.path.iterdir()) == ["device=0.arrow", "manifest.json"]
    assert torch.equal(read_full_state(run.root, "actor", 10)["w"], torch.ones(2, 3))
    assert [r.step for r in list_snapshots(run.root, "actor", incarnation=1)] == [10]
    with pytest.raises(
        SnapshotNotFoundError, match="actor has no snapshot at step 10 written by incarnation 0"
    ):
        find_snapshot(run.root, "actor", 10, incarnation=0)
    with pytest.raises(SnapshotExistsError):  # the driver's own snapshot is immutable
        write_snapshot(run.root, "actor", 10, _shards(2.0), incarnation=1)


def test_a_checkpoints_snapshots_are_never_rewritten_by_a_later_driver(run: RunDir) -> None:
    write_snapshot(run.root, "actor", 4, _shards(4.0), incarnation=0)
    run.write_checkpoint(4, RECORD)
    run.begin_incarnation()
    with pytest.raises(SnapshotExistsError, match="already committed"):
        write_snapshot(run.root, "actor", 4, _shards(5.0), incarnation=1)
    record = run.latest_checkpoint()
    assert record is not None
    ref = find_snapshot(run.root, "actor", 4, incarnation=record["incarnation"])
    assert torch.equal(read_full_state(run.root, "actor", 4)["w"], torch.full((2, 3), 4.0))
    assert ref.manifest.incarnation == 0


def test_unstamped_writes_keep_the_old_rule(tmp_path: Path) -> None:
    """Without an incarnation (no run.json needed) a committed snapshot is never rewritten."""
    write_snapshot(tmp_path, "actor", 1, _shards(1.0))
    with pytest.raises(SnapshotExistsError):
        write_snapshot(tmp_path, "actor", 1, _shards(2.0))
    assert find_snapshot(tmp_path, "actor", 1).manifest.incarnation is None
