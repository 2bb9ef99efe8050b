"""storage/retention.py: the newest complete checkpoints are kept, whole; nothing half-written counts."""

from __future__ import annotations

import torch

from nereus_core.emu import Box, SliceSpec
from nereus_core.layout import Layout
from storage import list_snapshots, read_full_state, write_snapshot
from storage.retention import complete_checkpoints, discard_partial, has_checkpoint, prune_checkpoints
from storage.run_dir import RunDir

ONE_SLOT = Layout(devices=(0,)).model_dump(mode="json")
PLAN = {"actor/train": ONE_SLOT, "reference/infer": ONE_SLOT}
MODELS = ("actor", "reference")


def _snapshot(run: RunDir, model: str, step: int) -> None:
    w = torch.full((2, 3), float(step))
    whole = SliceSpec((2, 3), Box.full((2, 3)))
    incarnation = run.identity().incarnation
    write_snapshot(run.root, model, step, {0: {"w": (w, whole)}}, incarnation=incarnation)


def _checkpoint(run: RunDir, step: int, models: tuple[str, ...] = MODELS) -> None:
    """Every model's snapshot, then the record: what the job writes."""
    for model in models:
        _snapshot(run, model, step)
    run.write_checkpoint(step, {"plan_id": "p", "plan": PLAN, "devices": 1, "response_len": 4})


def _steps_on_disk(run: RunDir, model: str) -> list[int]:
    return sorted(int(p.name.split("=")[1]) for p in (run.root / "state" / model).iterdir())


def test_the_newest_complete_checkpoints_are_kept_whole_and_the_older_ones_deleted(tmp_path) -> None:
    run = RunDir.create(tmp_path / "run", {})
    for step in (2, 4, 6, 8):
        _checkpoint(run, step)
    assert prune_checkpoints(run.root, 2) == [2, 4]
    assert run.checkpoint_steps() == [6, 8] and complete_checkpoints(run.root) == [6, 8]
    for model in MODELS:
        assert _steps_on_disk(run, model) == [6, 8]
        assert read_full_state(run.root, model, 6)["w"].eq(6).all()  # the kept ones read back whole
    assert run.latest_checkpoint()["step"] == 8


def test_a_half_written_checkpoint_is_not_counted_nor_used_and_never_deletes_a_complete_one(tmp_path) -> None:
    run = RunDir.create(tmp_path / "run", {})
    _checkpoint(run, 2)
    _checkpoint(run, 4)
    _snapshot(run, "actor", 6)  # the writer died after the actor: no reference, no record
    assert complete_checkpoints(run.root) == [2, 4]
    assert prune_checkpoints(run.root, 2) == []  # still two complete ones: nothing goes
    assert run.checkpoint_steps() == [2, 4] and run.latest_checkpoint()["step"] == 4
    assert _steps_on_disk(run, "actor") == [2, 4, 6]  # newer than the newest complete: left for its writer
    # A record whose snapshots are not all committed is not a complete checkpoint either.
    _snapshot(run, "actor", 8)
    run.write_checkpoint(8, {"plan_id": "p", "plan": PLAN, "devices": 1, "response_len": 4})
    assert complete_checkpoints(run.root) == [2, 4]
    assert prune_checkpoints(run.root, 1) == [2]
    assert run.checkpoint_steps() == [4, 8]


def test_leftovers_older_than_the_newest_complete_checkpoint_are_deleted(tmp_path) -> None:
    run = RunDir.create(tmp_path / "run", {})
    _checkpoint(run, 2)
    _snapshot(run, "actor", 3)  # a failed write's leftover
    _snapshot(run, "transition-actor-train", 3)  # a durable switch's intermediate snapshot
    _checkpoint(run, 4)
    assert prune_checkpoints(run.root, 3) == []
    assert _steps_on_disk(run, "actor") == [2, 4]
    assert _steps_on_disk(run, "transition-actor-train") == []
    assert [r.step for r in list_snapshots(run.root, "reference")] == [2, 4]


def test_keep_zero_keeps_everything_and_another_runs_records_are_left_alone(tmp_path) -> None:
    old = RunDir.create(tmp_path / "run", {})
    _checkpoint(old, 1)
    run = RunDir.create(tmp_path / "run", {})  # a new run in the same directory: a new run id
    assert not has_checkpoint(run.root, 1) and complete_checkpoints(run.root) == []
    for step in (2, 4, 6):
        _checkpoint(run, step)
    assert prune_checkpoints(run.root, 0) == []
    assert run.checkpoint_steps() == [1, 2, 4, 6]
    assert prune_checkpoints(run.root, 1) == [2, 4]
    assert run.checkpoint_steps() == [1, 6] and _steps_on_disk(run, "actor") == [1, 6]


def test_discard_partial_removes_a_failed_attempts_snapshots_but_never_a_checkpoints(tmp_path) -> None:
    run = RunDir.create(tmp_path / "run", {})
    _checkpoint(run, 2)
    _snapshot(run, "actor", 4)
    assert discard_partial(run.root, 2, MODELS) == []
    assert [p.parent.name for p in discard_partial(run.root, 4, MODELS)] == ["actor"]
    assert _steps_on_disk(run, "actor") == [2]
    _snapshot(run, "actor", 4)  # the retry writes it afresh (a committed snapshot is never rewritten)
    assert [r.step for r in list_snapshots(run.root, "actor")] == [2, 4]
