"""How much faster than each baseline could any controller be, in the simulator's world? (JSON out)

The ceiling of adaptation: at each sampled step of a trace, the fastest plan of Nereus's whole
plan space (colocated, generation | the rest, phased) found with the world's *true* stage
seconds in place of the cost model's, switches free, micro-batches re-picked in truth
(``World.tune``), and memory checked as the job checks it. No controller that plans in this
space can beat it; a switch only costs more. Beside it, on the same steps, each fixed strategy
of the trace as the sweep runs it (its oracle-picked or documented plan, DP rescaled when the
devices change, micro-batches re-picked in truth, OpenRLHF's weight sync one tensor at a time).

Below the ceiling, the floor of any plan of any shape (``World.floor_s``: one generation call and
the longest response's decode iterations, each pass phase's fixed cost once and its FLOPs spread
over every device with no bubble, TP traffic, imbalance, sync or memory limit): what no system in
this world can beat, in or out of this plan space.

Reported per trace: each strategy's sampled mean true step, ``ceiling`` and ``floor``; the
strategy's total over the ceiling's (above 1: the best plan per step is that much faster); each
one's total over the floor's (``over_floor``: no plan can be more than that factor faster).
Step times are the world's (``World.step_s``: pools take turns, as the job runs). The search's
tables are the cost model's candidates; the ceiling is over those layouts, so it bounds what this
controller's search can reach, not every conceivable plan.

verl and OpenRLHF hold their train and forward weights sharded over their data-parallel ranks,
as their strategies set the world (``World.sharded_weights``: verl's FSDP, OpenRLHF's ZeRO-3).
With ``--sharded-weights`` Nereus's side (static and the ceiling) is held that way too: a what-if,
since Nereus's cost model, search and runtime know ZeRO-1 only (the ceiling's candidates are still
the search's, pruned by ZeRO-1 memory).

    python -m benchmarks.plan_headroom [--samples 24] [--seed 0] [--traces fixed-64 grow-1024]
                                       [--sharded-weights]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from nereus_core.controller.search import Searcher, SearchSpace
from nereus_core.cost.hardware import get_profile
from nereus_core.cost.stage_cost import Scales
from nereus_core.plan import GlobalPlan
from nereus_core.sim.config import SimConfig, parse_sim_config
from nereus_core.sim.job import make_strategy
from nereus_core.sim.peers import sample_steps
from nereus_core.sim.splits import usable_bytes
from nereus_core.sim.strategies import FixedStrategy, rescale
from nereus_core.sim.trace import Trace
from nereus_core.sim.world import World
from tasks.sim_tasks import load_traces

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "paper_sim.yaml"


class TruthSearcher(Searcher):
    """The controller's search with every candidate's seconds the world's truth for this step."""

    def __init__(self, world: World, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.world = world
        self._true: dict[tuple[str, int], Any] = {}

    def table(self, stage: str, first: int):
        key = (stage, first % self.profile.devices_per_node)
        if key not in self._true:
            t = super().table(stage, first)
            true = [self.world.truth_s(stage, t.layout(i, first), self.work) for i in range(len(t.seconds))]
            self._true[key] = replace(t, seconds=np.where(np.isfinite(t.seconds), true, np.inf))
        return self._true[key]


def true_step_s(
    world: World, plan: GlobalPlan, k: int, usable: float, *, per_tensor: bool, sharded: bool
) -> float:
    """The world's step time of ``plan`` at step ``k`` with micro-batches re-picked in truth (inf: no fit)."""
    world.per_tensor_sync, world.sharded_weights = per_tensor, sharded
    tuned, fits, seconds = world.tune(plan, world.trace.workloads[k], usable)
    sync = world.true_sync_s(tuned)
    world.per_tensor_sync = world.sharded_weights = False
    return world.step_s(tuned, seconds, sync) if fits else float("inf")


def ceiling(
    world: World, k: int, config: SimConfig, usable: float, *, sharded: bool = False
) -> tuple[float, GlobalPlan]:
    """The fastest plan in truth at step ``k`` among the search's best plan per split and its variants."""
    s, tr = config.controller, world.trace
    space = SearchSpace(
        devices=int(tr.devices[k]),
        budget=usable,
        disaggregated=s.disaggregated,
        overlap=False,
        buckets=s.memory_buckets,
    )
    search = TruthSearcher(
        world, space, tr.workloads[k], world.models, world.profile, Scales(), stages=world.stages
    )
    found = search.run()
    plans = [f.plan for f in found.feasible] + [f.plan for f in found.variants]
    if not plans:
        raise ValueError(f"trace {tr.name}, step {k}: no plan of the search fits {usable:.3g} bytes a device")
    return min(
        ((true_step_s(world, p, k, usable, per_tensor=False, sharded=sharded), p) for p in plans),
        key=lambda t: t[0],
    )


def evaluate(
    config: SimConfig,
    trace: Trace,
    strategies: list[str],
    samples: int,
    seed: int,
    *,
    nereus_sharded: bool = False,
) -> dict[str, Any]:
    world = World(trace, config.model, get_profile(config.profile), config.noise, seed, stages=config.stages)
    fixed: dict[str, tuple[GlobalPlan, bool, bool]] = {}  # plan, per-tensor sync, sharded weights
    for name in strategies:
        strategy = make_strategy(config, name)
        if isinstance(strategy, FixedStrategy):
            plan = strategy.initial_plan(world)
            # As its strategy set the world for it (a baseline's broadcast, its sharded weights); the
            # strategies of Nereus's plan space (static) shard only in the what-if.
            sharded = world.sharded_weights or nereus_sharded
            fixed[name] = (plan, world.per_tensor_sync, sharded)
            world.per_tensor_sync = world.sharded_weights = False
    totals = {name: 0.0 for name in fixed} | {"ceiling": 0.0, "floor": 0.0}
    unfit = {name: 0 for name in fixed}
    picks: dict[str, int] = {}
    steps = sample_steps(trace.steps, samples)
    for k in steps:
        world.begin_step(k)
        usable = usable_bytes(trace.memory_bytes(k), config.controller.headroom)
        best, plan = ceiling(world, k, config, usable, sharded=nereus_sharded)
        totals["ceiling"] += best
        totals["floor"] += sum(world.floor_s(k).values())
        picks[plan.placement] = picks.get(plan.placement, 0) + 1
        for name, (base, per_tensor, sharded) in fixed.items():
            start, now = int(trace.devices[0]), int(trace.devices[k])
            run = base if now == start else rescale(base, start, now, int(trace.batch[k]))
            seconds = true_step_s(world, run, k, usable, per_tensor=per_tensor, sharded=sharded)
            unfit[name] += not np.isfinite(seconds)
            totals[name] += seconds
    # A plan that does not fit a sampled step has no step time there (the sweep charges it a failed
    # attempt and a restart instead); its ratio is left out.
    fits = {n for n in fixed if not unfit[n]} | {"ceiling", "floor"}
    return {
        "trace": trace.name,
        "seed": seed,
        "sampled_steps": len(steps),
        "mean_true_step_s": {n: round(totals[n] / len(steps), 2) for n in sorted(fits)},
        "over_ceiling": {
            n: round(totals[n] / totals["ceiling"], 4) for n in sorted(fits - {"ceiling", "floor"})
        },
        "over_floor": {n: round(totals[n] / totals["floor"], 4) for n in sorted(fits - {"floor"})},
        "does_not_fit_steps": {n: c for n, c in unfit.items() if c},
        "ceiling_placements": picks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=24, help="Steps sampled evenly per trace.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traces", nargs="+", default=None, help="Trace names (default: all of the config).")
    parser.add_argument(
        "--sharded-weights",
        action="store_true",
        help="Shard Nereus's side (static, the ceiling) too, as the peers shard (a what-if).",
    )
    args = parser.parse_args()
    config = parse_sim_config(yaml.safe_load(CONFIG.read_text()))
    traces = load_traces.fn(config, str(CONFIG.parent))  # the parsing alone, no Prefect run
    results = []
    for spec in config.traces:
        if args.traces and spec.name not in args.traces:
            continue
        started = time.perf_counter()
        names = list(config.strategies_for(spec))
        trace = replace(traces[spec.name], ppo_epochs=config.ppo_epochs)
        out = evaluate(config, trace, names, args.samples, args.seed, nereus_sharded=args.sharded_weights)
        out["sharded_weights"] = args.sharded_weights
        out["wall_s"] = round(time.perf_counter() - started, 1)
        results.append(out)
        print(json.dumps(out), flush=True)
    print(json.dumps({"benchmark": "plan_headroom", "config": CONFIG.name, "results": results}, indent=2))


if __name__ == "__main__":
    main()
