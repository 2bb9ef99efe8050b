"""`nereus report DIR`: plots of a run into DIR/plots (PNG).

    scores.png       rule and reward-model score per step, the scenario's events marked
    stage_times.png  seconds per stage, stacked (a colour each), each transition as its own bar
                     (forced or chosen by the controller), the scenario's events marked
    transitions.json predicted vs actual seconds of each transition, step time before and after

Boundary: reads the run directory only (storage.run_dir); the figures are built apart from their
saving so that tests inspect them.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from nereus_core.config import parse_config
from nereus_core.plan import ModelStage
from storage.errors import RunDirError
from storage.run_dir import STEPS_TABLE, TRANSITIONS_TABLE, RunDir


def _read_summary(run: RunDir) -> dict[str, Any]:
    """``summary.json`` as a mapping whose history entries have what the plots need; a damaged or edited
    file is a ``RunDirError`` naming it and what is wrong."""
    path = run.root / "summary.json"
    try:
        summary = run.read_summary()
    except RunDirError:
        raise
    except (ValueError, UnicodeDecodeError) as err:  # truncated mid-write, or not JSON at all
        raise RunDirError(f"{path} is damaged: not valid JSON ({' '.join(str(err).split())})") from None
    if not isinstance(summary, dict):
        raise RunDirError(f"{path} is damaged: expected a JSON object, got {type(summary).__name__}")
    history = summary.get("history", [])
    needed = ("step", "rule_score", "score")
    if not isinstance(history, list) or not all(_has(h, needed) for h in history):
        raise RunDirError(f"{path} is damaged: 'history' must be a list of entries with {', '.join(needed)}")
    return summary


def _has(entry: object, keys: tuple[str, ...]) -> bool:
    return isinstance(entry, dict) and all(k in entry for k in keys)


# Qualitative palette for the stages: tab20's 20 colours without its reds, which mark forced
# transitions; every stage gets its own (actor/generate and actor/sync were both blue).
# Its strong shades first, then its light ones, so that neighbouring stages differ most.
_TAB20 = plt.get_cmap("tab20").colors
STAGE_COLORS = tuple(_TAB20[i] for i in [*range(0, 20, 2), *range(1, 20, 2)] if i not in (6, 7))
FORCED_COLOR, CHOSEN_COLOR, EVENT_COLOR = "#8b0000", "#333333", "#7b3294"
LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 7, "borderaxespad": 0.0}


def scenario_events(run: RunDir) -> list[tuple[int, str]]:
    """The scenario's events as ``(step, what)``, from config.yaml's ``job.scenario``."""
    try:
        scenario = run.read_config().get("job", {}).get("scenario") or []
    except RunDirError:
        return []
    out = []
    for e in scenario:
        if not isinstance(e, dict) or not isinstance(e.get("step"), int):
            continue
        what = [f"{k} -> {e[k]}" for k in ("devices", "response_len") if e.get(k) is not None]
        out.append((e["step"], ", ".join(what)))
    return out


def _mark_events(ax: Any, events: list[tuple[int, str]]) -> None:
    """Each event as a dotted line just before its step (it takes effect before the step runs)."""
    for step, what in events:
        ax.axvline(
            step - 0.5, color=EVENT_COLOR, linestyle=":", linewidth=1.5, label=f"before step {step}: {what}"
        )


def scores_figure(
    summary: dict[str, Any], events: list[tuple[int, str]], *, reward_model: bool = True
) -> Figure:
    """The task's rule score per step and, when the job scored with a reward model (``reward_model``;
    GRPO trains on the rule score itself), the reward model's score."""
    history = summary.get("history", [])
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, [h["rule_score"] for h in history], label="rule score (task)")
    if reward_model:
        ax.plot(steps, [h["score"] for h in history], label="reward model score")
    _mark_events(ax, events)
    ax.set_xlabel("step (0-based)")
    ax.set_ylabel("mean score")
    ax.set_ylim(bottom=0)
    ax.legend(**LEGEND)
    ax.set_title("score per step")
    return fig


def _stage_bars(ax: Any, rows: list[dict[str, Any]], steps: list[int]) -> None:
    per_stage: dict[str, dict[int, float]] = defaultdict(dict)
    for r in rows:
        key = f"{r['model']}/{r['stage']}"
        per_stage[key][r["step"]] = per_stage[key].get(r["step"], 0.0) + r["duration_s"]
    if len(per_stage) > len(STAGE_COLORS):
        raise ValueError(f"{len(per_stage)} stages but {len(STAGE_COLORS)} distinct colours")
    bottom = [0.0] * len(steps)
    for (name, by_step), color in zip(per_stage.items(), STAGE_COLORS, strict=False):
        heights = [by_step.get(s, 0.0) for s in steps]
        ax.bar(steps, heights, bottom=bottom, label=name, color=color, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]


def _transition_bars(ax: Any, transitions: list[dict[str, Any]]) -> None:
    """Each transition as its own bar of seconds between the steps it separates, forced or chosen."""
    for forced, color, label in ((True, FORCED_COLOR, "forced"), (False, CHOSEN_COLOR, "chosen")):
        mine = [t for t in transitions if bool(t.get("forced")) is forced]
        if mine:
            ax.bar(
                [t["step"] + 0.5 for t in mine],
                [t.get("actual_s") or 0.0 for t in mine],
                width=0.3,
                color=color,
                hatch="//" if forced else "",
                edgecolor="white",
                label=f"transition ({label}; its own seconds)",
            )


def stage_times_figure(run: RunDir, events: list[tuple[int, str]]) -> Figure:
    rows = run.read_rows(STEPS_TABLE)
    wall = {r["step"]: r.get("step_wall_s", 0.0) for r in rows}
    steps = sorted(wall)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    _stage_bars(ax, rows, steps)
    ax.plot(steps, [wall[s] for s in steps], "k.", label="step wall time")
    _transition_bars(ax, run.read_rows(TRANSITIONS_TABLE))
    _mark_events(ax, events)
    ax.set_xlabel("step (0-based); transitions between the steps they separate")
    ax.set_ylabel("seconds")
    ax.set_title("time per stage (stacked) and per transition")
    ax.legend(**LEGEND)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120, bbox_inches="tight")  # "tight" keeps the legend beside the axes
    plt.close(fig)
    return path


def transitions_table(run: RunDir, around: int = 3) -> list[dict]:
    """Each transition with its predicted and actual seconds and the mean step wall time of up to
    ``around`` steps before it (up to its step) and after it."""
    wall = {r["step"]: r.get("step_wall_s", 0.0) for r in run.read_rows(STEPS_TABLE)}

    def mean(steps: list[int]) -> float | None:
        got = [wall[s] for s in steps if s in wall]
        return sum(got) / len(got) if got else None

    out = []
    for t in run.read_rows(TRANSITIONS_TABLE):
        s = t["step"]
        out.append(
            {
                "transition_id": t["transition_id"],
                "status": t["status"],
                "forced": bool(t.get("forced")),
                "route": t.get("route", ""),
                "reason": t["reason"],
                "predicted_s": t["predicted_cost_s"],
                "actual_s": t["actual_s"],
                "checkpoint_s": t.get("checkpoint_s", 0.0),
                "step_s_before": mean(list(range(s - around + 1, s + 1))),
                "step_s_after": mean(list(range(s + 1, s + 1 + around))),
            }
        )
    return out


def _transitions(run: RunDir, summary: dict[str, Any], out: Path) -> Path:
    rows = transitions_table(run)
    share = summary.get("transition_s_total", 0.0) / summary["wall_s"] if summary.get("wall_s") else 0.0
    path = out / "transitions.json"
    path.write_text(json.dumps({"transition_share_of_run": share, "transitions": rows}, indent=2))
    return path


def write_report(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the plots of a finished (or running) job into ``run_dir/plots``, and its transitions
    (predicted vs actual time, step time before and after) into ``plots/transitions.json``."""
    run = RunDir(run_dir)
    if not (run.root / "summary.json").exists():
        raise FileNotFoundError(f"{run.root} has no summary.json; is it a run directory?")
    summary = _read_summary(run)
    out = run.root / "plots"
    out.mkdir(exist_ok=True)
    events = scenario_events(run)
    reward_model = ModelStage.REWARD_INFER in parse_config(run.read_config()).stages
    return [
        _save(scores_figure(summary, events, reward_model=reward_model), out / "scores.png"),
        _save(stage_times_figure(run, events), out / "stage_times.png"),
        _transitions(run, summary, out),
    ]
