"""benchmarks/compare_runs.py tells two runs apart by everything but time."""

from __future__ import annotations

import math

from benchmarks.compare_runs import history_differences, timing


def test_timings_are_left_out_and_every_other_field_is_compared() -> None:
    a = [{"step": 0, "score": 0.5, "wall_s": 1.0, "phase_train_s": 0.2, "kl": math.nan}]
    b = [{"step": 0, "score": 0.5, "wall_s": 9.0, "phase_train_s": 0.7, "kl": math.nan}]
    assert timing("wall_s") and timing("phase_train_pools") and not timing("score")
    assert history_differences(a, b) == []


def test_a_changed_value_a_missing_field_and_a_missing_row_are_named() -> None:
    a = [{"step": 0, "score": 0.5, "plan_id": "p1"}, {"step": 1, "score": 0.6, "plan_id": "p1"}]
    b = [{"step": 0, "score": 0.5, "plan_id": "p2"}]
    assert history_differences(a, b) == ["history rows: 2 != 1", "step 0 plan_id: 'p1' != 'p2'"]
    c = [{"step": 0, "score": 0.5}, {"step": 1, "score": 0.6000001, "plan_id": "p1"}]
    assert history_differences(a, c) == [
        "step 0 plan_id: 'p1' != '<missing>'",
        "step 1 score: 0.6 != 0.6000001",
    ]
