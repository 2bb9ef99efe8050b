"""A live switch colocated -> phased -> colocated in the running job: every model's state after each
switch equals, bit for bit, the checkpoint written just before it (``job.verify_transitions``), the
actor's log-probs on a probe batch are unchanged, and the step on the phased plan runs its phases'
pools at once (tests/support/phased_jobs.py: the plans).

The controller is told which plan to switch to after steps 0 and 1 (tests/support/forced_switches.py),
as the scenario events of the other switch tests force theirs."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from flows.job import switch as switch_module
from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from nereus_core.plan import plan_id
from storage.run_dir import RunDir
from tests.support.forced_switches import forced_controller
from tests.support.job_runs import plans_by_step
from tests.support.phased_jobs import COLOCATED_PLAN, PHASED_PLAN, intervals, layouts, overlap, phased_job

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server


@pytest.mark.slow  # about 100 s: a full job with two live switches
@pytest.mark.timeout(600)
def test_colocated_to_phased_and_back_keeps_every_state_bitwise(tmp_path, monkeypatch) -> None:
    phased, colocated = layouts(PHASED_PLAN), layouts(COLOCATED_PLAN)
    monkeypatch.setenv("NEREUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(switch_module, "controller_step", forced_controller({0: phased, 1: colocated}))
    data = phased_job(COLOCATED_PLAN, steps=3, adapt=True, verify_transitions=True)
    out = tmp_path / "run"
    rl_job(config=parse_config(data), out_dir=str(out))
    run = RunDir(out)
    assert run.read_summary()["status"] == "completed"
    rows = pq.read_table(out / "metrics" / "transitions.parquet").to_pylist()
    assert [(r["step"], r["status"], r["route"]) for r in rows] == [
        (0, "committed", "live"),
        (1, "committed", "live"),
    ]
    for r in rows:  # live state == the checkpoint before the switch; log-probs within 1e-5
        assert r["verified_bitwise"] is True and r["verified_max_diff"] <= 1e-5, r
    assert [r["to_plan_id"] for r in rows] == [plan_id(phased), plan_id(colocated)]
    assert plans_by_step(out) == {0: plan_id(colocated), 1: plan_id(phased), 2: plan_id(colocated)}
    history = run.read_rows("metrics/history.parquet")
    assert [h["phase_train_pools"] for h in history] == [1, 2, 1]
    found = intervals(
        pq.read_table(out / "metrics" / "steps.parquet").to_pylist(), 1, ("actor/train", "critic/train")
    )
    assert overlap(found["actor/train"], found["critic/train"]) > 0  # the phased step ran them at once
