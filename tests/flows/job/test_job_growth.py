"""flows/job/growth.py and the transition records the calibration is read back from:
when the job grows without a pause, with a tiny fake pool (no Dask, no Prefect)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from flows.job.growth import Growing
from flows.job.records import past_transitions
from nereus_core import job
from nereus_core.config import NereusConfig, parse_config
from nereus_core.layout import Layout
from nereus_core.plan import MODEL_STAGES

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny_ppo.yaml"


def demo(scenario: list[dict[str, Any]] | None = None, **cluster: Any) -> NereusConfig:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["job"]["scenario"] = scenario or []
    data["cluster"].update(cluster)
    return parse_config(data)


@dataclass
class FakePool:
    """What Growing asks of the pool: its size, the workers reported and warm, and prepare."""

    size: int
    reported: int = 0
    warm: int = 0
    prepared: list[int] = field(default_factory=list)

    @property
    def ready_devices(self) -> int:
        return max(self.size, self.warm)

    def reported_devices(self) -> int:
        return max(self.size, self.reported)

    def prepare(self, devices: int, warm: Any = None) -> None:
        self.prepared.append(devices)


def test_a_resume_onto_more_devices_starts_on_the_checkpoint_s_and_grows_once_they_are_warm() -> None:
    cfg = demo()
    plan = job.start(cfg).layouts
    point = job.ResumePoint(10, plan, 4, 2, 6, {})
    start, grow_to = job.resume_start(point)
    assert grow_to == 4 and start is not None and start.devices == 2 and not start.replan
    state = job.resumed(cfg, start)
    assert state.config.cluster.devices == 2 and state.layouts == dict(start.layouts)
    pool, growing = FakePool(size=2), Growing(target=grow_to)
    assert growing.event(pool, state, 10) is None and pool.prepared == [4]  # not warm yet: run on 2
    pool.warm = 4
    event = growing.event(pool, state, 11)
    assert event is not None and event.devices == 4 and growing.target is None
    state, what = job.apply_event(state, event)
    assert what == ["devices 2 -> 4"] and state.config.cluster.devices == 4
    # As many devices as the checkpoint, fewer, or a finished switch that needs the new ones: as asked.
    assert job.resume_start(replace(point, devices=2))[1] is None
    assert job.resume_start(replace(point, devices=1))[1] is None
    wide = {s: Layout.contiguous(dp=4) for s in MODEL_STAGES}
    assert job.resume_start(replace(point, layouts=wide))[1] is None
    assert job.resume_start(None) == (None, None)


def test_workers_a_scheduler_reports_are_prepared_and_joined_only_up_to_max_devices() -> None:
    state = job.start(demo(max_devices=3))
    pool, growing = FakePool(size=2, reported=5), Growing()
    assert growing.event(pool, state, 3) is None and pool.prepared == [3]
    pool.warm = 3
    event = growing.event(pool, state, 4)
    assert event is not None and event.devices == 3
    without = job.start(demo())  # cluster.max_devices unset: the scheduler's other workers stay unused
    idle = FakePool(size=2, reported=5, warm=5)
    assert Growing().event(idle, without, 3) is None and idle.prepared == []


def test_a_scenario_grow_ahead_is_prepared_and_left_to_its_event() -> None:
    state = job.start(demo([{"step": 10, "devices": 4}]))
    pool = FakePool(size=2, warm=4)
    assert Growing().event(pool, state, 0) is None and pool.prepared == [4]


def test_past_transitions_are_the_committed_rows_with_their_terms() -> None:
    row = {
        "status": "committed",
        "predicted_cost_s": 0.3,
        "actual_s": 0.4,
        "predicted_wire_s": 0.01,
        "predicted_ops_s": 0.2,
        "predicted_durable_s": 0.05,
    }
    old = {k: v for k, v in row.items() if not k.startswith("predicted_") or k == "predicted_cost_s"}
    rows = [row, {**row, "status": "refused"}, old, {**row, "actual_s": 0.0}]
    got = past_transitions(rows)
    assert len(got) == 1 and got[0].seconds == 0.4
    # a row written before the engine, recovery and verify terms existed reads them as 0
    assert got[0].predicted.terms == (0.01, 0.2, 0.05, 0.0, 0.0, 0.0) and got[0].predicted.seconds == 0.3
    later = {"predicted_engine_s": 30.0, "predicted_recovery_s": 0.5, "predicted_verify_s": 0.25}
    with_engine = past_transitions([{**row, **later}])
    assert with_engine[0].predicted.terms == (0.01, 0.2, 0.05, 30.0, 0.5, 0.25)
