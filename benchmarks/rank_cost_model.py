"""Does the calibrated cost model rank the plans that compete as the simulator's world does? (JSON out)

The controller only needs the cost model to order plans correctly, so this measures the order,
not the error of one prediction. For each pool size it runs the adaptive strategy (the real
controller, ``nereus`` in examples/paper_sim.yaml) through the fixed-size ORZ-7B trace in the
simulator, then, at the last step, with the scales calibrated on everything the run observed:

- ``stages``: per model-stage, every candidate layout of the search's table (from slot 0) that
  fits the usable memory alone; the competing ones are the union of the 12 fastest by the
  calibrated model and the 12 fastest in the world (``world.World.truth_s``). Reported: the
  Spearman rank correlation of predicted and true seconds over them, and the median relative
  error of the prediction there.
- ``plans``: whole plans, the best plan of every pool split the search solves
  (``Searcher.splits``, each solved as the search solves it) plus its one-stage variants of the
  best, that fit the usable memory; predicted by the controller's ``evaluate_plan``, true by the
  world (its stage times on the plan and its weight sync, combined by its own rule, ``World.step_s``).
  Reported: Spearman over them, and the regret of the plan the model ranks first (its true step
  time over the best true step time among them, minus one), and the same for the plan the run
  ended on.
- ``run``: the calibrated scales, the run's mean true step time, the generation layouts it used
  and the step at which generation's TP first changed.

Targets: Spearman >= 0.7 and regret <= 3%.

Figures, dated and with their commands, are in docs/results/ (the index there names the latest).

    python -m benchmarks.rank_cost_model [--devices 64 1024] [--steps N] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from nereus_core.controller.decide import ControllerState, evaluate_plan
from nereus_core.controller.search import Searcher, SearchResult, SearchSpace
from nereus_core.cost.hardware import get_profile
from nereus_core.plan import GENERATE, GlobalPlan
from nereus_core.sim.config import SimConfig, parse_sim_config
from nereus_core.sim.job import make_strategy
from nereus_core.sim.loop import simulate
from nereus_core.sim.splits import usable_bytes
from nereus_core.sim.strategies import NereusStrategy
from nereus_core.sim.trace import parse_trace
from nereus_core.sim.world import World

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "paper_sim.yaml"
TRACE = ROOT / "data" / "traces" / "orz7b_fixed.csv"
TOP = 12
TARGET_SPEARMAN, TARGET_REGRET = 0.7, 0.03


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation (ties take their mean rank); None below three points."""
    if len(a) < 3:
        return None
    ra, rb = _ranks(np.asarray(a, dtype=float)), _ranks(np.asarray(b, dtype=float))
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def competing(predicted: np.ndarray, truth: np.ndarray, top: int = TOP) -> np.ndarray:
    """Indices of the union of the ``top`` fastest by prediction and by truth."""
    return np.union1d(np.argsort(predicted)[:top], np.argsort(truth)[:top])


def run_sim(
    config: SimConfig, devices: int, steps: int | None, seed: int
) -> tuple[World, NereusStrategy, list]:
    trace = parse_trace(TRACE.read_text(), name=f"fixed-{devices}", devices=devices, steps=steps)
    world = World(trace, config.model, get_profile(config.profile), config.noise, seed, stages=config.stages)
    strategy = make_strategy(config, "nereus")
    assert isinstance(strategy, NereusStrategy)
    records, _ = simulate(world, strategy, trace=trace.name, seed=seed)
    return world, strategy, records


def searcher(world: World, state: ControllerState, k: int, usable: float) -> Searcher:
    s = state.settings
    space = SearchSpace(
        devices=int(world.trace.devices[k]),
        budget=usable,
        disaggregated=s.disaggregated,
        overlap=s.overlap_disaggregated,
        buckets=s.memory_buckets,
    )
    work = world.trace.workloads[k]
    wire = state.transition_scales.wire
    return Searcher(space, work, state.models, state.profile, state.scales, wire, stages=state.stages)


def stage_ranks(world: World, search: Searcher, usable: float) -> dict[str, dict[str, Any]]:
    """Per model-stage: Spearman and median relative error over its competing layouts."""
    work = world.trace.workloads[world.k]
    out = {}
    for stage in world.stages:
        table = search.table(stage, 0)
        idx = np.flatnonzero(table.persistent + table.transient <= usable)
        predicted = table.seconds[idx]
        truth = np.array([world.truth_s(stage, table.layout(int(i), 0), work) for i in idx])
        pick = competing(predicted, truth)
        best_true = int(idx[np.argmin(truth)])
        best_pred = int(idx[np.argmin(predicted)])
        out[stage] = {
            "candidates": len(idx),
            "competing": len(pick),
            "spearman": _round(spearman(predicted[pick], truth[pick])),
            "median_rel_error": round(float(np.median(np.abs(predicted[pick] / truth[pick] - 1))), 3),
            "best_by_model": table.layout(best_pred, 0).key.split("@")[0],
            "best_in_world": table.layout(best_true, 0).key.split("@")[0],
            "regret": round(float(truth[np.argmin(predicted)] / truth.min() - 1), 4),
        }
    return out


def search_plans(search: Searcher) -> list[GlobalPlan]:
    """The best plan of every pool split (each solved as ``Searcher.run`` solves it, none skipped)
    and the one-stage variants of the best."""
    result = SearchResult()
    for placement, parts in search.splits():
        search._solve(placement, parts, result)  # every split, not only those that can beat the best
    result.feasible.sort(key=lambda f: f.seconds)
    plans = [f.plan for f in result.feasible]
    if result.feasible:
        plans += [f.plan for f in search._variants(result.feasible[0])]
    unique: dict[str, GlobalPlan] = {}
    for p in plans:
        unique.setdefault(p.plan_id, p)
    return list(unique.values())


def true_step_s(world: World, plan: GlobalPlan, usable: float, overlap: bool) -> float:
    work = world.trace.workloads[world.k]
    ran, stages = world.run_plan(plan, work, usable)
    return world.step_s(ran, stages, world.true_sync_s(ran))


def plan_ranks(
    world: World, state: ControllerState, search: Searcher, usable: float, in_force: GlobalPlan
) -> dict[str, Any]:
    work = world.trace.workloads[world.k]
    overlap = state.settings.overlap_disaggregated
    plans, predicted, truth = [], [], []
    for plan in search_plans(search):
        e = evaluate_plan(plan, work, state, int(usable))
        if e.memory_peak <= usable:
            plans.append(plan)
            predicted.append(e.step_s)
            truth.append(true_step_s(world, plan, usable, overlap))
    p, t = np.array(predicted), np.array(truth)
    chosen = int(np.argmin(p))
    force = true_step_s(world, in_force, usable, overlap)
    return {
        "plans": len(plans),
        "spearman": _round(spearman(p, t)),
        "chosen": plans[chosen].describe(),
        "chosen_true_s": round(float(t[chosen]), 2),
        "best_true_s": round(float(t.min()), 2),
        "best": plans[int(np.argmin(t))].describe(),
        "regret": round(float(t[chosen] / t.min() - 1), 4),
        "in_force_regret": round(float(force / t.min() - 1), 4),
    }


def generation_tp_change(records: list[dict], plans: dict[str, GlobalPlan]) -> int | None:
    first = plans[records[0]["plan_id"]].layouts[GENERATE].tp
    for r in records:
        if plans[r["plan_id"]].layouts[GENERATE].tp != first:
            return int(r["step"])
    return None


def evaluate(config: SimConfig, devices: int, steps: int | None, seed: int) -> dict[str, Any]:
    used: dict[str, GlobalPlan] = {}
    world, strategy, records = run_sim(config, devices, steps, seed)
    state = strategy.state
    assert state is not None and strategy.plan is not None
    # The plans the run used, by id (the records carry ids only): replayed from the controller's history.
    for r in state.records:
        used[r.plan_id] = r.plan
    used[strategy.plan.plan_id] = strategy.plan
    k = world.steps - 1
    world.begin_step(k)
    usable = usable_bytes(world.trace.memory_bytes(k), state.settings.headroom)
    search = searcher(world, state, k, usable)
    stages = stage_ranks(world, search, usable)
    rhos = [s["spearman"] for s in stages.values() if s["spearman"] is not None]
    gen_tps = [
        used[r["plan_id"]].layouts[GENERATE].key.split("@")[0] for r in records if r["plan_id"] in used
    ]
    return {
        "devices": devices,
        "steps": world.steps,
        "seed": seed,
        "stages": stages,
        "stage_spearman_mean": _round(statistics.fmean(rhos) if rhos else None),
        "stage_spearman_min": _round(min(rhos) if rhos else None),
        "plans": plan_ranks(world, state, search, usable, strategy.plan),
        "run": {
            "scales": {k: round(v, 3) for k, v in state.scales.model_dump().items()},
            "mean_true_step_s": round(statistics.fmean(r["true_step_s"] for r in records), 2),
            "switches": sum(r["move"] in ("switch", "retune") for r in records),
            "generation_layouts": sorted(set(gen_tps)),
            "generation_tp_first_change_step": generation_tp_change(
                [r for r in records if r["plan_id"] in used], used
            ),
        },
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--steps", type=int, default=None, help="Trace steps to run (default: all).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = parse_sim_config(yaml.safe_load(CONFIG.read_text()))
    results = [evaluate(config, n, args.steps, args.seed) for n in args.devices]
    out = {
        "benchmark": "rank_cost_model",
        "trace": TRACE.name,
        "targets": {"spearman": TARGET_SPEARMAN, "regret": TARGET_REGRET},
        "results": results,
        "meets_targets": all(
            (r["stage_spearman_min"] or 0) >= TARGET_SPEARMAN
            and (r["plans"]["spearman"] or 0) >= TARGET_SPEARMAN
            and r["plans"]["regret"] <= TARGET_REGRET
            for r in results
        ),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
