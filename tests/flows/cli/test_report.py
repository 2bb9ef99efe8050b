"""flows/cli/report.py: plots of a small synthetic run directory, checked on the figure objects."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex
from matplotlib.container import BarContainer

from flows.cli import report
from storage.run_dir import STEPS_TABLE, TRANSITIONS_TABLE, RunDir
from tests.support.step_rows import STAGES

# STAGES: the (model, stage) rows of a PPO step as flows/job/rl_job.py records them.
EVENTS = [{"step": 3, "devices": 4}, {"step": 5, "response_len": 12}]


@pytest.fixture
def run(tmp_path) -> RunDir:
    run = RunDir.create(tmp_path / "run", {"name": "synthetic", "job": {"steps": 7, "scenario": EVENTS}})
    rows = [
        {"step": s, "model": m, "stage": st, "duration_s": 0.1 + 0.01 * i, "step_wall_s": 1.5}
        for s in range(7)
        for i, (m, st) in enumerate(STAGES)
    ]
    run.write_rows(STEPS_TABLE, rows)
    transitions = [
        {"transition_id": "t000-step0", "step": 0, "forced": False, "actual_s": 0.6, "status": "committed"},
        {"transition_id": "t001-step2", "step": 2, "forced": True, "actual_s": 14.2, "status": "committed"},
        {"transition_id": "t002-step4", "step": 4, "forced": True, "actual_s": 1.8, "status": "committed"},
    ]
    for t in transitions:
        t.update(reason="x", predicted_cost_s=0.5, route="live")
    run.write_rows(TRANSITIONS_TABLE, transitions)
    history = [{"step": s, "score": 0.2 + 0.05 * s, "rule_score": 0.1 + 0.05 * s} for s in range(7)]
    run.write_summary({"status": "completed", "wall_s": 30.0, "transition_s_total": 16.6, "history": history})
    return run


def _bars(ax) -> dict[str, BarContainer]:
    return {c.get_label(): c for c in ax.containers if isinstance(c, BarContainer)}


def test_every_stage_has_its_own_colour_and_transitions_their_own_bars(run):
    fig = report.stage_times_figure(run, report.scenario_events(run))
    try:
        ax = fig.axes[0]
        bars = _bars(ax)
        stage_names = [f"{m}/{s}" for m, s in STAGES]
        assert set(stage_names) <= set(bars)
        colours = {name: to_hex(bars[name].patches[0].get_facecolor()) for name in bars}
        assert len(set(colours.values())) == len(colours), colours  # no two bar series share a colour
        forced = bars["transition (forced; its own seconds)"]
        chosen = bars["transition (chosen; its own seconds)"]
        assert [p.get_height() for p in forced.patches] == [14.2, 1.8]
        assert [p.get_x() + p.get_width() / 2 for p in forced.patches] == pytest.approx([2.5, 4.5])
        assert [p.get_height() for p in chosen.patches] == [0.6]
        assert forced.patches[0].get_hatch() and not chosen.patches[0].get_hatch()
        legend = ax.get_legend()
        texts = [t.get_text() for t in legend.get_texts()]
        assert (
            "transition (forced; its own seconds)" in texts
            and "transition (chosen; its own seconds)" in texts
        )
        assert "before step 3: devices -> 4" in texts and "before step 5: response_len -> 12" in texts
        assert set(stage_names) <= set(texts)
        # The legend sits right of the axes, so it covers no bar.
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
    finally:
        plt.close(fig)


def test_the_score_plot_marks_the_scenario_events(run):
    fig = report.scores_figure(run.read_summary(), report.scenario_events(run))
    try:
        ax = fig.axes[0]
        texts = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "before step 3: devices -> 4" in texts and "before step 5: response_len -> 12" in texts
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert list(lines["before step 3: devices -> 4"].get_xdata()) == [2.5, 2.5]
    finally:
        plt.close(fig)


def test_the_stage_palette_is_distinct_and_apart_from_the_transition_colours():
    colours = [to_hex(c) for c in report.STAGE_COLORS]
    assert len(colours) >= len(STAGES) and len(set(colours)) == len(colours)
    marks = {to_hex(c) for c in (report.FORCED_COLOR, report.CHOSEN_COLOR, report.EVENT_COLOR)}
    assert len(marks) == 3 and not marks & set(colours)


def test_write_report_writes_the_plots_and_says_which_transitions_were_forced(run):
    paths = report.write_report(run.root)
    assert [p.name for p in paths] == ["scores.png", "stage_times.png", "transitions.json"]
    assert all(p.stat().st_size > 0 for p in paths)
    rows = json.loads(paths[2].read_text())["transitions"]
    assert [r["forced"] for r in rows] == [False, True, True]
