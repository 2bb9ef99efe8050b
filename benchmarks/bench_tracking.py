"""Per-step cost of trainer.logger's trackers, side by side with none, in one run (JSON out).

For each tracker set (none, tensorboard, mlflow, wandb, and all three), a fresh run directory,
the trackers opened as a run opens them (``JobRecords.tracking``), then N steps of realistic
metrics logged as ``JobRecords.finish_step`` logs them: a history row of the PPO job's statistics
and the 12 stage rows of a PPO step, turned into verl's names (``step_metrics``) and sent to every
tracker. Reported per set: median and mean milliseconds per step (wall clock), the open and close
seconds, and the median over none's. A tracker whose package is missing is reported as skipped.

    python -m benchmarks.bench_tracking [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from flows.job.records import JobRecords
from flows.job.tracking import require, step_metrics
from nereus_core.config import ConfigError, parse_config
from storage.run_dir import RunDir
from tests.support.step_rows import STAGES

SETS = {"none": [], "tensorboard": ["tensorboard"], "mlflow": ["mlflow"], "wandb": ["wandb"]}
SETS["all"] = ["tensorboard", "mlflow", "wandb"]


def step_inputs(step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A history row and stage rows shaped as the PPO job's (values vary so nothing is constant)."""
    x = 1.0 + step / 100
    stats = {
        "step": step,
        "plan_id": "p1a2b3c4",
        "score": 0.2 * x,
        "rule_score": 0.15 * x,
        "kl": 1e-3 * x,
        "tokens": 1536,
        **{f"actor_{k}": 0.1 * x for k in ("loss", "clip_frac", "approx_kl", "entropy", "grad_norm")},
        **{f"critic_{k}": 0.2 * x for k in ("loss", "value_clip_frac", "grad_norm")},
        "response_len_mean": 6.0,
        "response_len_max": 6.0,
        "response_clip_frac": 1.0,
        "wall_s": 2.0 * x,
        "stage_s": 1.9 * x,
        "overhead_s": 0.1 * x,
    }
    rows = [{"model": m, "stage": s, "duration_s": 0.1 * x} for m, s in STAGES]
    return stats, rows


def measure(names: list[str], steps: int, root: Path) -> dict[str, Any]:
    try:
        require(names)
    except ConfigError as err:
        return {"skipped": str(err)}
    run = RunDir.create(root, {"name": "bench"})
    cfg = parse_config({"name": "bench", "job": {"steps": steps}, "trainer": {"logger": ["console", *names]}})
    records = JobRecords(run, config=cfg)
    inputs = [step_inputs(s) for s in range(steps)]
    per_step = []
    start = time.perf_counter()
    with records.tracking():
        opened = time.perf_counter() - start
        for step, (stats, rows) in enumerate(inputs):
            t = time.perf_counter()
            records.trackers.log(step_metrics(stats, rows), step)  # as finish_step does
            per_step.append(time.perf_counter() - t)
        closing = time.perf_counter()
    return {
        "open_s": round(opened, 4),
        "close_s": round(time.perf_counter() - closing, 4),
        "median_ms_per_step": round(1000 * statistics.median(per_step), 4),
        "mean_ms_per_step": round(1000 * statistics.fmean(per_step), 4),
        "metrics_per_step": len(step_metrics(*inputs[0])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    result: dict[str, Any] = {"steps": args.steps, "sets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, names in SETS.items():
            result["sets"][name] = measure(names, args.steps, Path(tmp) / name)
    base = result["sets"]["none"]["median_ms_per_step"]
    for got in result["sets"].values():
        if "median_ms_per_step" in got:
            got["over_none_ms_per_step"] = round(got["median_ms_per_step"] - base, 4)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
