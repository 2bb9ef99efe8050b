"""`nereus report DIR`: plots of a run into DIR/plots (PNG)."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

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


def _scores(summary: dict[str, Any], out: Path) -> Path:
    history = summary.get("history", [])
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [h["rule_score"] for h in history], label="rule score (task)")
    ax.plot(steps, [h["score"] for h in history], label="reward model score")
    ax.set_xlabel("step")
    ax.set_ylabel("mean score")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("score per step")
    path = out / "scores.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _stage_times(run: RunDir, out: Path) -> Path:
    rows = run.read_rows(STEPS_TABLE)
    per_stage: dict[str, dict[int, float]] = defaultdict(dict)
    wall: dict[int, float] = {}
    for r in rows:
        per_stage[f"{r['model']}/{r['stage']}"][r["step"]] = r["duration_s"]
        wall[r["step"]] = r.get("step_wall_s", 0.0)
    steps = sorted(wall)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(steps)
    for name, by_step in per_stage.items():
        heights = [by_step.get(s, 0.0) for s in steps]
        ax.bar(steps, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.plot(steps, [wall[s] for s in steps], "k.", label="step wall time")
    for t in run.read_rows(TRANSITIONS_TABLE):
        ax.axvline(t["step"] + 0.5, color="red", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("time per stage (stacked)")
    ax.legend(fontsize=7, ncol=2)
    path = out / "stage_times.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
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
    return [_scores(summary, out), _stage_times(run, out), _transitions(run, summary, out)]
