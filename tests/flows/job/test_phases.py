"""flows/job/phases.py and the records' phase bookkeeping, without a device pool: which slot groups a phase
runs, a single slot group run in the flow's thread, and the busy time of stages that overlapped."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from flows.job import phases
from flows.job.records import busy_s
from nereus_core.config import parse_config
from nereus_core.config.from_yaml import parse_yaml
from nereus_core.plan import infer_placement
from nereus_core.rl.algorithms import PPO
from tests.support.phased_jobs import COLOCATED_PLAN, PHASED_PLAN, layouts

PASSES = tuple(p.stage for p in PPO.passes)  # PPO's forward passes over the rollout

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny_ppo_phased.yaml"


def _passes(plan: dict) -> dict:
    return {s: v for s, v in layouts(plan).items() if s in PASSES}


def test_the_forward_passes_of_a_phased_plan_form_two_pools_and_a_colocated_plan_one() -> None:
    assert phases.slot_groups_of(_passes(PHASED_PLAN)) == (
        ("actor/train", "reference/infer"),
        ("critic/infer", "reward/infer"),
    )
    trains = {s: v for s, v in layouts(PHASED_PLAN).items() if s.endswith("/train")}
    assert phases.slot_groups_of(trains) == (("actor/train",), ("critic/train",))
    assert len(phases.slot_groups_of(_passes(COLOCATED_PLAN))) == 1


def test_the_serial_switch_runs_every_phase_as_one_pool(monkeypatch) -> None:
    monkeypatch.setattr(phases, "AT_ONCE", False)
    assert phases.slot_groups_of(_passes(PHASED_PLAN)) == (tuple(_passes(PHASED_PLAN)),)


def test_one_pool_runs_in_this_thread_in_order() -> None:
    seen = []

    def task(*, x: int) -> int:
        seen.append((x, threading.get_ident()))
        return 10 * x

    (ran,) = phases.run_slot_groups(task, [[{"x": 1}, {"x": 2}]])
    assert [r.result for r in ran] == [10, 20] and seen == [
        (1, threading.get_ident()),
        (2, threading.get_ident()),
    ]
    assert ran[0].start <= ran[1].start and all(r.seconds >= 0 for r in ran)


@pytest.mark.parametrize(
    ("spans", "busy"),
    [
        ([(0.0, 1.0), (1.0, 0.5)], 1.5),  # one after another: the sum
        ([(0.0, 1.0), (0.5, 1.0)], 1.5),  # overlapping by 0.5: counted once
        ([(0.0, 2.0), (0.5, 0.5), (3.0, 1.0)], 3.0),  # one inside another, then a gap
    ],
)
def test_busy_time_counts_overlapping_stages_once(spans, busy) -> None:
    rows = [{"start_s": s, "duration_s": d} for s, d in spans]
    assert busy_s(rows) == pytest.approx(busy)


def test_the_phased_example_is_a_phased_plan_whose_phases_run_slot_groups_at_once() -> None:
    cfg = parse_config(parse_yaml(EXAMPLE.read_text()))
    assert infer_placement(cfg.plan) == "phased" and cfg.cluster.devices == 4 and not cfg.job.adapt
    passes = {s: v for s, v in cfg.plan.items() if s in PASSES}
    trains = {s: v for s, v in cfg.plan.items() if s.endswith("/train")}
    assert len(phases.slot_groups_of(passes)) == 2 and len(phases.slot_groups_of(trains)) == 2
