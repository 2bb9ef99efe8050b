"""The step table: a timed row shows its seconds and share, a reused pass says so instead."""

from __future__ import annotations

from flows.job.step_report import step_table

STATS = {"wall_s": 2.0, "overhead_s": 0.1, "score": 0.5, "rule_score": 0.4}


def test_a_reused_pass_shows_reused_instead_of_a_time() -> None:
    rows = [
        {"model": "actor", "stage": "generate", "duration_s": 0.5, "tokens": 64},
        {"model": "actor", "stage": "infer", "duration_s": 0.0, "tokens": 96, "reused": True},
    ]
    lines = step_table(rows, STATS).splitlines()
    assert lines[1].split() == ["actor", "generate", "0.500", "25.0%", "64"]
    assert lines[2].split() == ["actor", "infer", "reused", "96"]
