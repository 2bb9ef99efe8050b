"""Fault injection inside running jobs: each fault ends with the job completed and nothing lost.

- a snapshot write fails (disk full) before a switch: the switch is aborted, plan A stays in force
  and the job goes on;
- a device worker is killed while the state is rehydrated into a grown pool: the world is rebuilt
  and the rehydration redone;
- the driver is killed while a transition moves state: ``nereus resume`` finishes the switch from
  the checkpoint and carries on.

"Nothing lost" is checked against the checkpoint written before each switch: the old log-probs
the job stored for the next rollout were computed by the actor after the fault, and they equal
transformers' on the actor read back from that checkpoint; the checkpoint itself reads back
bitwise unchanged after recovery.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.job.rl_job import rl_job
from nereus_core import faults
from nereus_core.config import parse_config
from storage import list_snapshots
from storage.journal import journals
from storage.run_dir import RunDir
from tests.support.job_configs import FAULT_JOB
from tests.support.job_runs import (
    CLI,
    ROOT,
    assert_rollout_made_by_checkpoint,
    cli_env,
    digests,
    kill_after_checkpoint,
    killed_mid_move,
    plans_by_step,
    resume_from_checkpoint,
    start_run,
)

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server


def _config(**job: object) -> dict:
    data = copy.deepcopy(FAULT_JOB)
    data["job"].update(job)
    return data


def _run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict, fault: str, out: Path | None = None
) -> Path:
    out = out or tmp_path / "run"
    monkeypatch.setenv("NEREUS_CACHE_DIR", str(tmp_path / "cache"))
    faults.arm([fault])  # as the CLI does; the device pool arms it on the workers it starts
    try:
        rl_job(config=parse_config(config), out_dir=str(out))
    finally:
        faults.arm(())
    return out


@pytest.mark.slow  # about 35 s: sync recovery only (the default, async: test_switch_recovery.py)
def test_failing_snapshot_writer_keeps_plan_a_and_the_job_goes_on(tmp_path, monkeypatch):
    run_dir = _run(tmp_path, monkeypatch, _config(snapshot_every=2), "fail-snapshot-write")
    summary = RunDir(run_dir).read_summary()
    assert summary["status"] == "completed" and summary["steps"] == 3
    rows = pq.read_table(run_dir / "metrics" / "transitions.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["aborted"]
    assert "checkpoint could not be written" in rows[0]["reason"]
    plans = plans_by_step(run_dir)
    assert plans[0] == plans[1] == plans[2]  # plan A stayed in force
    # The half-written snapshot never became visible; the final one is complete and readable.
    assert all(ref.step != 1 for ref in list_snapshots(run_dir, "actor"))
    assert any(":exp_avg" in name for name in digests(run_dir, 3)["actor"])
    # Plan A's state went on training: the checkpoint of step 2 is the actor that scored rollout 2.
    assert_rollout_made_by_checkpoint(run_dir, 2, tmp_path)


@pytest.mark.slow  # about 65 s: a worker killed during a resume
def test_worker_killed_during_rehydration_is_replaced_and_the_job_completes(tmp_path, monkeypatch):
    config = _config(scenario=[{"step": 1, "devices": 4}], verify_transitions=True)
    config["cluster"]["devices"] = 2
    config["cluster"]["memory_per_device"] = "16MiB"
    run_dir = _run(tmp_path, monkeypatch, config, "kill-worker:rehydrate")
    summary = RunDir(run_dir).read_summary()
    assert summary["status"] == "completed" and summary["transitions"] == 1
    (journal,) = [j for j in journals(run_dir) if j.transition_id.startswith("t000")]
    entries = journal.entries()
    assert any(e["op"] == "rehydrate#1" and e["phase"] == "failed" for e in entries)
    assert {e["op"] for e in entries if e["phase"] == "done"} >= {
        "rehydrate:actor/train#2",
        "rehydrate:critic/train#2",
        "resize:2->4",
    }
    assert journal.status() == "committed"
    (row,) = pq.read_table(run_dir / "metrics" / "transitions.parquet").to_pylist()
    assert row["route"] == "durable" and row["verified_bitwise"] and row["verified_max_diff"] <= 1e-5
    # The state rehydrated after the kill is the checkpoint's: the actor it made scored rollout 1
    # exactly as transformers does on the checkpoint.
    assert_rollout_made_by_checkpoint(run_dir, 1, tmp_path)


@pytest.mark.timeout(600)  # in the default suite: about 60 s on a quiet 2-core machine
def test_driver_killed_during_a_transfer_then_resume_finishes_the_switch(tmp_path):
    out, journal = killed_mid_move(tmp_path, _config(verify_transitions=True), timeout_s=240)
    # The driver died half way: units moved state (bytes transferred, their done lines written), while
    # work remained (units of later waves, or the inference copies' relinks). The live state is gone
    # with the workers; resume finishes the switch from the checkpoint, trusting no unit of the dead
    # driver.
    schedule = [u for wave in journal.header()["schedule"] for u in wave]
    done = [e for e in journal.entries() if e["phase"] == "done"]
    assert done and done[0]["op"] in schedule and done[0]["bytes_moved"] > 0
    assert not any(e["op"].startswith("relink:") for e in done)
    assert not (out / "summary.json").exists()

    # Rehydrated on plan B == the checkpoint plan A was safe in, bitwise; that checkpoint untouched.
    resume_from_checkpoint(tmp_path, out, 1)
    finished = [e for e in journal.entries() if e["op"] == "transition" and e["phase"] == "commit"]
    assert finished and finished[0]["finished_by"] == "resume"
    (resumed,) = [j for j in journals(out) if j.transition_id.startswith("resume-step1")]
    redone = {e["op"] for e in resumed.entries() if e["phase"] == "done"}
    assert {
        f"rehydrate:{s}#1" for s in ("actor/train", "critic/train", "reference/infer", "reward/infer")
    } <= redone
    plans = plans_by_step(out)
    assert sorted(plans) == [0, 1, 2] and plans[1] != plans[0]  # plan B from step 1 on
    assert_rollout_made_by_checkpoint(out, 1, tmp_path)


@pytest.mark.timeout(900)
@pytest.mark.slow  # about 70 s: a killed run resumed on fewer devices
def test_resume_on_fewer_devices_replans_and_completes(tmp_path):
    """A run on 4 slots killed after its checkpoint at step 2 resumes on 2: the controller re-plans."""
    data = _config(steps=5, snapshot_every=2, scenario=[], verify_transitions=True)
    data["cluster"]["memory_per_device"] = "64MiB"
    run, out = start_run(tmp_path, data)
    kill_after_checkpoint(run, out, 2, tmp_path)  # the driver dies once that checkpoint is complete
    summary = resume_from_checkpoint(tmp_path, out, 2, "--devices", "2")
    plans = {r["step"]: r for r in pq.read_table(out / "metrics" / "steps.parquet").to_pylist()}
    assert sorted(plans) == [0, 1, 2, 3, 4]
    final = json.loads((out / "plans" / f"{summary['final_plan_id']}.json").read_text())
    assert max(max(layout["devices"]) for layout in final.values()) <= 1  # on slots 0..1 only
    assert_rollout_made_by_checkpoint(out, 2, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_resume_on_more_devices_runs_on_the_checkpoint_s_until_the_new_workers_are_warm(tmp_path):
    """``nereus resume --devices 4`` of a run on 2 slots resumes on those 2 (its plan, bitwise),
    starts and warms two more workers while the steps run, and grows once they are warm: the grow's
    pause is the state movement, priced without starting or warming a worker."""
    data = _config(steps=14, snapshot_every=2, keep_checkpoints=0, scenario=[], verify_transitions=True)
    data["cluster"].update(devices=2, memory_per_device="64MiB")
    run, out = start_run(tmp_path, data)
    kill_after_checkpoint(run, out, 2, tmp_path)  # the driver dies once that checkpoint is complete
    resume_from_checkpoint(tmp_path, out, 2, "--devices", "4")
    rows = pq.read_table(out / "metrics" / "transitions.parquet").to_pylist()
    grows = [r for r in rows if r["status"] == "committed" and r["devices"] == 4]
    # Recorded "after step k", before step k + 1: the first resumed step is 2, so a grow whose workers
    # were warm when it began shows step 1.
    assert grows and grows[0]["step"] >= 1 and grows[0]["route"] == "durable", rows
    assert "2 -> 4" in grows[0]["reason"] and grows[0]["verified_bitwise"]
    assert grows[0]["predicted_durable_s"] < 1.0  # the world only: its workers were warm
    steps = pq.read_table(out / "metrics" / "steps.parquet").to_pylist()
    assert sorted({r["step"] for r in steps}) == list(range(14))


# -- a real full disk: a small tmpfs the test mounts (root with CAP_SYS_ADMIN), filled for real ------


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        why = (done.stderr.decode(errors="replace").strip() or "mount failed")[:200]
        pytest.skip(f"a real full disk needs a tmpfs mount (root with CAP_SYS_ADMIN): {why}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow  # about 40 s: a full tmpfs before a switch
def test_a_really_full_disk_aborts_the_switch_and_the_job_goes_on(tmp_path, monkeypatch, small_disk, caplog):
    run_dir = _run(tmp_path, monkeypatch, _config(), "fill-disk:switch", out=small_disk / "run")
    summary = RunDir(run_dir).read_summary()
    assert summary["status"] == "completed" and summary["steps"] == 3
    (row,) = pq.read_table(run_dir / "metrics" / "transitions.parquet").to_pylist()
    assert row["status"] == "aborted" and "checkpoint could not be written" in row["reason"]
    # the file system said so, not an injected exception
    errors = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert errors and "No space left on device" in errors[0] and "injected" not in errors[0]
    assert all(ref.step != 1 for ref in list_snapshots(run_dir, "actor"))  # nothing half-written shows
    plans = plans_by_step(run_dir)
    assert plans[0] == plans[1] == plans[2]  # plan A stayed in force
    assert any(":exp_avg" in name for name in digests(run_dir, 3)["actor"])


@pytest.mark.timeout(900)
@pytest.mark.slow  # about 85 s: a full tmpfs, a stopped run and a resume
def test_a_really_full_disk_before_a_device_change_stops_the_run_and_resume_completes_it(
    tmp_path, small_disk
):
    """A durable switch (2 -> 4 slots) needs its checkpoint; with the disk full the run stops with one
    line and loses nothing: the checkpoint before it stays, and resume (with room again) finishes."""
    event = {"step": 3, "devices": 4}  # keep_checkpoints=0: the resume leaves step 2's checkpoint to compare
    data = _config(steps=5, snapshot_every=2, keep_checkpoints=0, scenario=[event], verify_transitions=True)
    data["cluster"].update(devices=2, memory_per_device="16MiB")
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(data))
    out = small_disk / "run"
    failed = subprocess.run(
        [*CLI, "run", str(config), "--out", str(out)],
        cwd=ROOT,
        env=cli_env(tmp_path, "fill-disk:switch"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert failed.returncode == 1, failed.stderr[-3000:]
    (line,) = [x for x in failed.stderr.splitlines() if x.startswith("nereus: error: ")]
    assert "device set changed" in line and "nereus resume" in line
    assert RunDir(out).checkpoint_steps() == [2] and not (out / "summary.json").exists()
    resume_from_checkpoint(tmp_path, out, 2)
    rows = pq.read_table(out / "metrics" / "transitions.parquet").to_pylist()
    assert [r["route"] for r in rows if r["status"] == "committed"] == ["durable"]
