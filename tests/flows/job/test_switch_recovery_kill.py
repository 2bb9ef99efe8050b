"""A driver killed while a live switch moves state, in the recovery modes that write nothing first.

``async`` (the recovery point is still being written when the driver dies) and ``none`` (nothing is
written) both promise the newest complete checkpoint: ``nereus resume`` rolls the interrupted switch
back to it, runs the steps since again and makes the switch again. The run then ends where an
uninterrupted run of the same config ends: every model's final state bitwise equal (optimizer state
included) and the same history of losses and scores. (``sync``, which finishes the switch from the
checkpoint it wrote first: tests/flows/job/test_faults.py.)
"""

from __future__ import annotations

import copy

import pyarrow.parquet as pq
import pytest

from storage.journal import journals
from storage.run_dir import RunDir
from tests.support.job_configs import FAULT_JOB
from tests.support.job_runs import digests, killed_mid_move, resume_from_checkpoint, start_run
from tests.support.processes import kill_session

# The history's figures a rerun of a step must reproduce (its timings need not).
LEARNED = ("score", "rule_score", "kl", "tokens", "actor_loss", "actor_grad_norm", "critic_loss")


def _config(mode: str) -> dict:
    data = copy.deepcopy(FAULT_JOB)
    data["job"].update(
        steps=4,
        snapshot_every=2,  # the newest complete checkpoint before the switch: step 2's
        scenario=[{"step": 3, "response_len": 24}],  # a live switch after step 2
        switch_recovery=mode,
        verify_transitions=True,
    )
    return data


def _history(out) -> list[dict]:
    rows = pq.read_table(out / "metrics" / "history.parquet").to_pylist()
    return [{k: r[k] for k in ("step", *LEARNED)} for r in rows]


@pytest.mark.slow  # three job runs, about 3 minutes
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", ["async", "none"])
def test_a_driver_killed_mid_switch_resumes_to_the_uninterrupted_runs_state(tmp_path, mode):
    data = _config(mode)
    (tmp_path / "killed").mkdir()
    out, journal = killed_mid_move(tmp_path / "killed", data, timeout_s=400)
    assert journal.header()["checkpoint_step"] == (3 if mode == "async" else None)
    assert RunDir(out).checkpoint_steps() == [2]  # the switch's own recovery point never completed
    resume_from_checkpoint(tmp_path / "killed", out, 2)
    rolled = [e for e in journal.entries() if e["op"] == "transition" and e["phase"] == "abort"]
    assert rolled and rolled[0]["rolled_back_by"] == "resume"
    # The switch made again has a journal of its own (none of the dead driver's units is trusted).
    (again,) = [j for j in journals(out) if j.transition_id.startswith("t001")]
    assert again.status() == "committed" and again.header()["step"] == 2

    (tmp_path / "whole").mkdir()
    driver, whole = start_run(tmp_path / "whole", data)
    try:
        assert driver.wait(timeout=600) == 0, (tmp_path / "whole" / "driver.log").read_text()[-2000:]
    finally:
        kill_session(driver)
    assert RunDir(whole).read_summary()["status"] == "completed"
    assert digests(out, 4) == digests(whole, 4)
    assert _history(out) == _history(whole)
