"""Controller decision time at 1,024 devices x 6 model-stages, and the plans it picks for 8B PPO (JSON out).

Decision time: ``controller.decide`` on 1,024 H100 slots for Llama-3-8B PPO, from a
running state (a current plan, a full calibration history of 512 stage timings, six
new timings per step), so every part runs: refit, search, exact evaluation, transition
costs, admission. Median of 20 calls, wall clock and process CPU time (the machine may
be shared; CPU time is what the decision itself costs). The target is <= 50 ms.

Plan table: the plan picked from scratch for the same workload on 16, 64, 256 and
1,024 H100s, with the predicted step time, tokens/s per GPU and memory per slot.

    python -m benchmarks.bench_controller [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from nereus_core.config import LLAMA_3_8B as LLAMA_8B
from nereus_core.config import Workload
from nereus_core.controller.decide import ControllerState, Decision, Observation, StageTiming, decide
from nereus_core.cost.hardware import H100_SXM
from nereus_core.cost.stage_cost import estimate
from nereus_core.plan import PPO_STAGES, model_of, models_for

# 256 prompts x 4 samples; responses of ~1,000 tokens as in NeMo RL's 8B GRPO run (its docs' performance
# summary).
WORKLOAD = Workload(batch=1024, prompt_len=1024, response_mean=1024, response_high=2048)
CAPACITY = 80 * 10**9
GiB = 1024**3


def observation(devices: int, timings: tuple[StageTiming, ...] = ()) -> Observation:
    return Observation(
        step=100,
        remaining_steps=900,
        devices=devices,
        memory_per_device=CAPACITY,
        workload=WORKLOAD,
        timings=timings,
    )


def running_state(devices: int) -> tuple[ControllerState, tuple[StageTiming, ...]]:
    """A controller 100 steps into a job: its plan, 512 samples, and one step's six timings."""
    first = decide(
        observation(devices), ControllerState.initial(models_for(LLAMA_8B), H100_SXM, stages=PPO_STAGES)
    )
    state = first.state
    timings = tuple(
        StageTiming(stage=s, layout=layout, seconds=1.3 * first.chosen.stages[s].seconds)
        for s, layout in first.plan.layouts.items()
    )
    history = decide(observation(devices, timings * 86), state).state  # 516 timings, 512 kept
    return history.model_copy(update={"steps_since_switch": 10}), timings


def decision_time(devices: int, calls: int) -> dict[str, object]:
    state, timings = running_state(devices)
    obs = observation(devices, timings)
    walls, cpus = [], []
    decision: Decision | None = None
    for _ in range(calls):
        wall, cpu = time.perf_counter(), time.process_time()
        decision = decide(obs, state)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    assert decision is not None
    return {
        "devices": devices,
        "model_stages": len(state.plan.layouts),
        "calls": calls,
        "calibration_samples": len(decision.state.samples),
        "median_wall_ms": round(1e3 * statistics.median(walls), 2),
        "median_cpu_ms": round(1e3 * statistics.median(cpus), 2),
        "p90_wall_ms": round(1e3 * sorted(walls)[int(0.9 * (calls - 1))], 2),
        "target_ms": 50,
        "action": decision.action,
        "reason": decision.reason,
    }


def plan_row(devices: int) -> dict[str, object]:
    start = time.perf_counter()
    d = decide(
        observation(devices), ControllerState.initial(models_for(LLAMA_8B), H100_SXM, stages=PPO_STAGES)
    )
    elapsed = time.perf_counter() - start
    if d.chosen is None:
        return {"devices": devices, "plan": None, "reason": d.reason}
    tokens = WORKLOAD.batch * (WORKLOAD.prompt_len + WORKLOAD.response_mean)
    stages = {
        s: f"tp{v.tp}.pp{v.pp}.dp{v.dp} m{v.micro_batches} ({d.chosen.stages[s].seconds:.2f} s)"
        for s, v in d.plan.layouts.items()
    }
    gen = d.plan.layouts["actor/generate"]
    decode_share = estimate("actor/generate", gen, WORKLOAD, LLAMA_8B, H100_SXM).seconds / d.chosen.step_s
    return {
        "devices": devices,
        "plan_id": d.plan.plan_id,
        "placement": d.plan.placement,
        "step_s": round(d.chosen.step_s, 2),
        "generation_share": round(decode_share, 2),
        "weight_sync_s": round(d.chosen.sync_s, 3),
        "tokens_per_s_per_gpu": round(tokens / d.chosen.step_s / devices, 1),
        "memory_per_slot_gib": round(d.chosen.memory_peak / GiB, 1),
        "stages": stages,
        "decide_ms": round(1e3 * elapsed, 1),
        "models": sorted({model_of(s) for s in d.plan.layouts}),
    }


def table(rows: list[dict[str, object]]) -> str:
    head = f"{'GPUs':>5} {'placement':<13} {'step s':>7} {'tok/s/GPU':>9} {'GiB/slot':>8}  stages"
    lines = [head]
    for r in rows:
        stages = "; ".join(f"{s}={v}" for s, v in r["stages"].items())  # type: ignore[union-attr]
        lines.append(
            f"{r['devices']:>5} {r['placement']:<13} {r['step_s']:>7} {r['tokens_per_s_per_gpu']:>9} "
            f"{r['memory_per_slot_gib']:>8}  {stages}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    rows = [plan_row(n) for n in (16, 64, 256, 1024)]
    result = {
        "benchmark": "controller",
        "model": "Llama-3-8B",
        "profile": H100_SXM.name,
        "workload": WORKLOAD.model_dump(),
        "decision_time": decision_time(1024, args.calls),
        "plans": rows,
        "plan_table": table(rows).splitlines(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
