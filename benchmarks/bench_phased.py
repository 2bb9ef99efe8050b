"""A phased plan against a colocated one: the same tiny PPO job on 4 slots, side by side in one run
(JSON out).

Three runs of the job of examples/tiny_ppo_phased.yaml (the demo's PPO job on 4 slots, adapt off),
one after another in this process, each a full ``rl_job`` with its own device pool:

    colocated      every model-stage on all four slots (tp1 pp2 dp2)
    phased-serial  the phased plan's layouts, each phase's stages one after another
                   (``flows.job.phases.AT_ONCE`` off: what the runtime did before phased plans)
    phased         the phased plan: generation on all four slots (dp4); the forward passes in two
                   pools ({old log-probs, reference} on 0-1, {critic, reward} on 2-3); actor/train on
                   0-1 and critic/train on 2-3 at once

Reported per run, over the steps after the first (its warm-up): the median step wall, the median
wall of each phase (``phase_<kind>_s`` of metrics/history.parquet), the median seconds of each stage
(metrics/steps.parquet), and the ratios of the medians side by side.

The physical limit: every device slot is a CPU worker process. With fewer cores than slots (2 cores,
4 slots here) the slots time-share the cores, so running two pools at once can at best hide the
time one pool's slots would have sat idle; it cannot make the compute itself faster than the cores
allow (two pools of two slots on two cores: at most the cores' worth, and each stage's own seconds
grow as the pools compete). The machine's load before and after is reported beside the figures.

    python -m benchmarks.bench_phased [--steps 6] [--config examples/tiny_ppo_phased.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from flows.job import phases
from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from nereus_core.config.from_yaml import parse_yaml
from storage.run_dir import STEPS_TABLE, RunDir

ROOT = Path(__file__).resolve().parents[1]
PHASE_KINDS = ("generate", "infer", "train")


def colocated(plan: dict[str, Any]) -> dict[str, Any]:
    """Every model-stage of ``plan`` on all four slots, tp1 pp2 dp2."""
    return {stage: {"tp": 1, "pp": 2, "dp": 2, "devices": [0, 1, 2, 3]} for stage in plan}


def measured(run_dir: Path) -> dict[str, Any]:
    """Medians over the steps after the first: step wall, each phase's wall, each stage's seconds."""
    run = RunDir(run_dir)
    history = run.read_rows("metrics/history.parquet")[1:]
    rows = [r for r in run.read_rows(STEPS_TABLE) if r["step"] >= 1]
    stages: dict[str, list[float]] = {}
    for r in rows:
        stages.setdefault(f"{r['model']}/{r['stage']}", []).append(r["duration_s"])
    steps = len(history)
    return {
        "steps_measured": steps,
        "step_wall_s": statistics.median(h["wall_s"] for h in history),
        "step_walls_s": [round(h["wall_s"], 4) for h in history],
        "phase_s": {
            k: statistics.median(h[f"phase_{k}_s"] for h in history)
            for k in PHASE_KINDS
            if f"phase_{k}_s" in history[0]
        },
        "phase_pools": {k: history[0].get(f"phase_{k}_pools") for k in PHASE_KINDS},
        # a stage that runs twice a step (the sync of two models) sums within the step first
        "stage_s": {k: statistics.median(v) * (len(v) // steps) for k, v in stages.items()},
        "stage_sum_s": statistics.median(h["stage_s"] for h in history),
        "final_rule_score": history[-1]["rule_score"],
    }


def run_one(name: str, data: dict[str, Any], root: Path, *, at_once: bool) -> dict[str, Any]:
    phases.AT_ONCE = at_once
    try:
        start = time.perf_counter()
        rl_job(config=parse_config(data), out_dir=str(root / name))
        total = time.perf_counter() - start
    finally:
        phases.AT_ONCE = True
    return {"run_s": round(total, 2), **measured(root / name)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny_ppo_phased.yaml"))
    args = parser.parse_args()
    data = parse_yaml(Path(args.config).read_text())
    data["job"].update(steps=args.steps, snapshot_every=0, adapt=False, scenario=[])
    result: dict[str, Any] = {
        "config": Path(args.config).name,
        "steps": args.steps,
        "cpu_cores": os.cpu_count(),
        "device_slots": data["cluster"]["devices"],
        "load_before": os.getloadavg(),
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("NEREUS_CACHE_DIR", str(Path(tmp) / "cache"))  # the reward fit, once
        variants = {
            "colocated": (colocated(data["plan"]), True),
            "phased-serial": (data["plan"], False),
            "phased": (data["plan"], True),
        }
        for name, (plan, at_once) in variants.items():
            result["runs"][name] = run_one(name, {**data, "plan": plan}, Path(tmp), at_once=at_once)
    result["load_after"] = os.getloadavg()
    runs = result["runs"]
    wall = {k: runs[k]["step_wall_s"] for k in runs}
    result["phased_over_colocated"] = round(wall["phased"] / wall["colocated"], 3)
    result["phased_over_phased_serial"] = round(wall["phased"] / wall["phased-serial"], 3)
    result["limit"] = (
        f"{result['device_slots']} slots on {result['cpu_cores']} cores: the slots time-share the cores, "
        "so pools at once can only hide idle slots' waits, not compute faster than the cores"
    )
    print(json.dumps(rounded(result), indent=2))


def rounded(value: Any) -> Any:
    """Floats to 4 decimals, inside any dicts, lists and tuples."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    return value


if __name__ == "__main__":
    main()
