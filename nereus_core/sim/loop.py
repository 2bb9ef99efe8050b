"""The step loop every strategy runs through: prepare a plan, time its stages in the world, move on.

Boundary: the loop owns the clock and the records; a strategy owns its plan
(``Strategy``) and the world owns the truth (``world.World``). Per step:

    plan <- strategy.prepare(k)              (baselines re-pick micro-batches here)
    stage seconds = true x noise             (what the job measures)
    step_s = world.step_s(stages, sync)      + the controller's time after the step
    move  <- strategy.after(k, measured)      (keep, switch, retune, rescale; its transition time)

A step's latency (``step_s``) is its stages, the weight sync, the controller's
decision time after it, and, when its plan does not fit in memory, the failed attempt
and a restart (``restart_s``) (the first decision, which picks the starting plan, is
charged to step 0). A strategy on Nereus's runtime writes a synchronous checkpoint after every
``checkpoint_every`` steps and after the last (``checkpoint_s``, ``World.checkpoint_s``), and its
restart reruns the steps since its last periodic checkpoint; the peers checkpoint at their own
cadence (``peers``), and a strategy charged no checkpoints (``checkpoint_every`` None, no shipped one)
restarts as if one were taken every step. When the trace's devices shrink without notice after
step k (``Trace.unplanned_shrink``), the steps since the strategy's last checkpoint are lost and
rerun (``lost_s``: their stage seconds, as they ran); the restart itself is the strategy's move
after step k. A transition's, a checkpoint's and lost steps' time are recorded on the step they
follow and count in the run's total time, not in any step's latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from nereus_core.config import Workload
from nereus_core.plan import GlobalPlan
from nereus_core.sim.trace import Trace
from nereus_core.sim.world import World

MoveKind = Literal["start", "keep", "switch", "retune", "rescale", "relaunch", "none"]
# Moves that change a layout's degrees, devices or placement: the paper's "transitions" (state moves),
# and a peer's relaunch (stop, restart on the new devices, reload its checkpoint).
TRANSITION_KINDS = ("switch", "rescale", "relaunch")


class SimError(RuntimeError):
    """The simulation cannot go on (e.g. no plan fits at the first step)."""


@dataclass
class Move:
    """What a strategy does at a step boundary."""

    plan: GlobalPlan
    kind: MoveKind = "keep"
    transition_s: float = 0.0  # true seconds of the transition it runs
    predicted_transition_s: float = 0.0  # the cost model's prediction of it (nereus)
    decide_s: float = 0.0  # controller seconds charged to the job
    decide_wall_s: float = 0.0  # wall seconds the controller took in this process
    decide_calls: int = 0  # controller calls behind this move
    reason: str = ""


@dataclass
class Prepared:
    """The plan a strategy runs at step k and each stage's true seconds on it."""

    plan: GlobalPlan
    true_s: dict[str, float]
    failed: bool = False  # the step first ran out of memory on the strategy's launch flags (peers)


@dataclass
class StepRun:
    """What step k measured, handed to the strategy after it."""

    k: int
    plan: GlobalPlan
    work: Workload
    measured: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)


class Strategy(Protocol):
    name: str
    checkpoint_every: int | None  # steps between its periodic checkpoints (0: the last only; None: none)

    def begin(self, world: World) -> Move: ...

    def prepare(self, k: int, world: World) -> Prepared: ...

    def predict(self, plan: GlobalPlan, work: Workload, world: World, k: int) -> float | None: ...

    def after(self, k: int, world: World, run: StepRun) -> Move: ...


def stage_column(stage: str) -> str:
    """``'actor/generate'`` -> ``'actor_generate_s'`` (a column name)."""
    return stage.replace("/", "_") + "_s"


def _trace_row(tr: Trace, k: int) -> dict[str, Any]:
    """What the trace says of step ``k``: the columns of its record that no strategy changes."""
    return {
        "devices": int(tr.devices[k]),
        "capacity_gb": float(tr.capacity_gb[k]),
        "batch": int(tr.batch[k]),
        "prompt_len": int(tr.prompt_len[k]),
        "response_mean": float(tr.response_mean[k]),
        "response_p90": int(tr.response_p90[k]),
        "tokens": tr.tokens(k),
    }


def _restart_and_checkpoint(
    world: World, plan: GlobalPlan, k: int, fits: bool, stage_s: float, every: int | None, since: float
) -> tuple[float, float, float, float]:
    """Step ``k``'s restart, periodic checkpoint and lost seconds, and the stage seconds since the last
    checkpoint after it. A step whose plan does not fit fails: its attempt is lost, the job restarts
    from its last checkpoint, reruns the steps since it (none for a strategy charged no checkpoints,
    ``every`` None: as if one were taken every step), then runs the step again. Devices lost without
    notice after step ``k`` lose the steps since the last checkpoint (rerun after the restart)."""
    restart = 0.0 if fits else stage_s + world.relaunch_s(k, plan) + since
    due = every is not None and (k + 1 == world.steps or (every > 0 and (k + 1) % every == 0))
    checkpoint = world.checkpoint_s(plan) if due else 0.0
    since = 0.0 if due or every is None else since + stage_s
    lost = since if world.trace.unplanned_shrink(k) else 0.0
    return restart, checkpoint, lost, since - lost


def simulate(world: World, strategy: Strategy, *, trace: str, seed: int) -> tuple[list[dict], dict[str, str]]:
    """Run ``strategy`` through every step of ``world``; the per-step records and the plans used."""
    tr = world.trace
    records: list[dict] = []
    plans: dict[str, str] = {}
    start = strategy.begin(world)
    carried_s, carried_wall, carried_calls = start.decide_s, start.decide_wall_s, start.decide_calls
    every, since_checkpoint = strategy.checkpoint_every, 0.0  # stage seconds since the last one
    for k in range(world.steps):
        work = tr.workloads[k]
        world.begin_step(k)
        prepared = strategy.prepare(k, world)
        plan = prepared.plan
        plans.setdefault(plan.plan_id, plan.describe())
        measured = {s: world.measured_stage_s(k, s, t) for s, t in prepared.true_s.items()}
        true_sync = world.true_sync_s(plan)
        sync = world.measured_sync_s(k, true_sync)
        stage_s = world.step_s(plan, measured, sync)
        true_s = world.step_s(plan, prepared.true_s, true_sync)
        predicted = strategy.predict(plan, work, world, k)
        fits = not prepared.failed and world.peak_bytes(plan, work) <= tr.memory_bytes(k)
        restart, checkpoint, lost, since_checkpoint = _restart_and_checkpoint(
            world, plan, k, fits, stage_s, every, since_checkpoint
        )
        move = strategy.after(k, world, StepRun(k, plan, work, measured))
        decide_s, decide_wall = carried_s + move.decide_s, carried_wall + move.decide_wall_s
        calls = carried_calls + move.decide_calls
        carried_s = carried_wall = 0.0
        carried_calls = 0
        records.append(
            {
                "trace": trace,
                "strategy": strategy.name,
                "seed": seed,
                "step": k,
                **_trace_row(tr, k),
                "plan_id": plan.plan_id,
                "placement": plan.placement,
                "devices_used": len(plan.devices),
                "fits": bool(fits),
                **{stage_column(s): measured.get(s, 0.0) for s in world.stages},
                "sync_s": sync,
                "stages_s": stage_s,
                "decide_s": decide_s,
                "decide_wall_s": decide_wall,
                "decide_calls": calls,
                "restart_s": restart,
                "checkpoint_s": checkpoint,
                "lost_s": lost,
                "step_s": stage_s + decide_s + restart,
                "true_step_s": true_s,
                "floor_step_s": sum(world.floor_s(k).values()),
                "predicted_step_s": math.nan if predicted is None else predicted,
                "move": move.kind,
                "transition_s": move.transition_s,
                "predicted_transition_s": move.predicted_transition_s,
                "reason": move.reason,
            }
        )
    return records, plans
