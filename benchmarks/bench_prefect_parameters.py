"""What Prefect's walk of a flow's or task's parameters costs the job, bare against ``quote``d.

Before a flow or task runs, Prefect walks its parameters, to any depth and into pydantic models and
dataclasses, looking for futures to resolve. Two of the job's parameters are large:

- the transition subflow's ``moves``: the controller's schedule, whose transition graph holds every
  op of the move; measured on an 8B PPO switch on 16 GPUs (every model-stage tp 8 -> tp 4);
- the controller task's job state, whose controller holds its plan records, calibration samples
  and stage timings by shape; measured on the simulated Nereus's state after ``--steps`` steps of
  the paper's growing trace (``examples/paper_sim_grow.yaml``).

Each is passed to a do-nothing subflow or task, bare and quoted, in one run, under a temporary
Prefect server. Prints JSON. The physical floor is a call's own overhead, the quoted figure.

    python -m benchmarks.bench_prefect_parameters [--steps 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

STAGES = ("actor/generate", "actor/train", "critic/train", "critic/infer", "reference/infer", "reward/infer")


@flow(name="bench-subflow", validate_parameters=False)
def _subflow(*, moves: Any = None) -> int:
    return len(moves.planned.graph.ops)


@task(cache_policy=NO_CACHE)
def _task(state: Any, *, step: int) -> str:
    return type(state).__name__


def _calls(fn: Any, value: Any, **kw: Any) -> dict[str, float]:
    """Seconds of one call of ``fn`` with ``value`` quoted, then bare, then again each."""
    out: dict[str, list[float]] = {"quoted": [], "bare": []}
    for name in ("quoted", "bare", "quoted", "bare"):
        start = time.perf_counter()
        fn(quote(value) if name == "quoted" else value, **kw)
        out[name].append(time.perf_counter() - start)
    return {k: round(min(v), 3) for k, v in out.items()}


@flow(name="bench-prefect-parameters")
def _measure(moves: Any, state: Any) -> dict[str, Any]:
    sub = _calls(lambda m: _subflow(moves=m), moves)
    tsk = _calls(lambda s: _task(s, step=1), state)
    return {"transition_subflow_s": sub, "controller_task_s": tsk}


def _schedule() -> Any:
    from nereus_core.config import LLAMA_3_8B
    from nereus_core.controller.moves import MoveBasis
    from nereus_core.controller.transition_schedule import schedule_moves
    from nereus_core.layout import Layout
    from nereus_core.plan import GlobalPlan, models_for

    devices = tuple(range(16))
    old = GlobalPlan.of({s: Layout(tp=8, dp=2, devices=devices) for s in STAGES})
    new = GlobalPlan.of({s: Layout(tp=4, dp=4, devices=devices) for s in STAGES})
    return schedule_moves(old, new, models_for(LLAMA_3_8B), MoveBasis(slots=16, memory_per_device=80 << 30))


def _controller_state(steps: int) -> Any:
    from flows.simulate import read_sim_config, sweep_jobs
    from nereus_core.cost.hardware import get_profile
    from nereus_core.sim.job import make_strategy
    from nereus_core.sim.loop import simulate
    from nereus_core.sim.trace import parse_trace
    from nereus_core.sim.world import World
    from tasks.sim_tasks import trace_path

    path = Path("examples/paper_sim_grow.yaml")
    cfg = read_sim_config(path)
    spec = cfg.traces[0]
    text = trace_path(spec.file, path.parent).read_text(encoding="utf-8")
    trace = parse_trace(text, name=spec.name, devices=spec.devices, steps=steps)
    job = next(j for j in sweep_jobs(cfg, {spec.name: trace}) if j.strategy == "nereus" and j.seed == 0)
    trace = replace(job.trace, ppo_epochs=cfg.ppo_epochs)
    world = World(trace, cfg.model, get_profile(cfg.profile), cfg.noise, 0, stages=cfg.stages)
    strategy = make_strategy(cfg, "nereus")
    simulate(world, strategy, trace=trace.name, seed=0)
    return strategy.state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="simulated steps behind the controller state")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    start = time.perf_counter()
    moves = _schedule()
    schedule_s = time.perf_counter() - start
    state = _controller_state(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PREFECT_HOME"] = str(Path(tmp) / "prefect")  # a Prefect database of its own
        figures = _measure(quote(moves), quote(state))
    report = {
        "machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
        "schedule": {"ops": len(moves.planned.graph.ops), "planned_s": round(schedule_s, 1)},
        "controller_state": {
            "steps": args.steps,
            "records": len(state.records),
            "samples": len(state.samples),
            "shapes": len(state.shapes),
        },
        **figures,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
