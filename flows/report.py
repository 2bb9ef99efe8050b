"""`nereus report DIR`: plots of a run into DIR/plots (PNG)."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from storage.run_dir import STEPS_TABLE, TRANSITIONS_TABLE, RunDir


def _scores(run: RunDir, out: Path) -> Path:
    history = run.read_summary().get("history", [])
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


def _transitions(run: RunDir, out: Path) -> Path:
    summary = run.read_summary()
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
    out = run.root / "plots"
    out.mkdir(exist_ok=True)
    return [_scores(run, out), _stage_times(run, out), _transitions(run, out)]
