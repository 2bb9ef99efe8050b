"""Nereus (adaptive) and the fixed-layout strategies: static, and the base the baselines build on.

- ``nereus``: the controller (``controller.decide``) after every step (or every k steps,
  and always when the devices or the capacity change), fed the stage times the world
  measured; it recalibrates, searches and switches when a plan pays for its move. It has only
  what the runtime has (``controller.features.runtime_settings``: no overlap). A
  switch's time is the world's true cost of what the controller estimated, with what the runtime
  writes for it (``checkpoints.SwitchWrites``: the job's recovery point, its verification), and is
  reported back to it so it calibrates the transition cost too. A checkpoint every
  ``snapshot_every`` steps is charged by the loop. Probes a decision asks for are answered by the
  world (``sim.probes``) and charged as the runtime runs them (``probes.charged_s``: their
  collectives, a device call each, their groups once per world), with the decision's seconds.
  Generation's waves are the rollout engine's, as for every strategy (``World.run_plan``: the
  engine admits what its KV budget holds); every other micro-batch count is the controller's.
- ``static``: the plan the controller picks at step 0 (the same start as nereus) with
  its TP/PP kept for the whole run; when the devices change, every stage's DP degree
  (and its slots) is scaled with them, and that rescale costs a transition like any
  other. Micro-batch counts (generation waves) are re-picked every step with the true
  cost, in its favour: vLLM admits what fits and trainers tune micro-batches. It runs on Nereus's
  runtime: the same rule of features, recovery points and periodic checkpoints as ``nereus``.
Every strategy plans the job's model-stages and no others (``World.stages``, which
``SimConfig.stages`` sets: PPO's six, GRPO's actor pair and the reference with a KL term).
A train stage that would not fit otherwise may turn on full activation recomputation at its time
cost (``World.run_plan``, ``World.tune``) where the strategy's runtime has it: the peers (launch
flags, ``peers``); nereus and static run Nereus's runtime, whose recomputation is the model's launch
flag (``features.activation_recompute``: on for every train pass, or never).
"""

from __future__ import annotations

import time

from nereus_core.config import ModelConfig, Workload
from nereus_core.controller import features
from nereus_core.controller.decide import (
    ControllerSettings,
    ControllerState,
    Decision,
    Observation,
    ProbeTiming,
    StageTiming,
    TransitionTiming,
    decide,
    evaluate_plan,
)
from nereus_core.controller.features import runtime_settings
from nereus_core.cost.hardware import HardwareProfile
from nereus_core.cost.transition_cost import analytic_transition_cost
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan, models_for
from nereus_core.sim import probes
from nereus_core.sim.checkpoints import SwitchWrites
from nereus_core.sim.config import DecisionSettings
from nereus_core.sim.loop import Move, Prepared, SimError, StepRun
from nereus_core.sim.splits import largest_dp, usable_bytes
from nereus_core.sim.world import World


def same_degrees(a: GlobalPlan, b: GlobalPlan) -> bool:
    """Whether two plans differ at most in micro-batch counts (no state has to move)."""
    if a.placement != b.placement or set(a.layouts) != set(b.layouts):
        return False
    return all(a.layouts[s].same_placement(b.layouts[s]) for s in a.layouts)


def first_observation(world: World) -> Observation:
    """What the controller sees before step 0 of the world's trace: the first plan is chosen on it."""
    tr = world.trace
    return Observation(
        step=0,
        remaining_steps=tr.steps,
        devices=int(tr.devices[0]),
        memory_per_device=tr.memory_bytes(0),
        workload=tr.workloads[0],
    )


class NereusStrategy:
    """The adaptive strategy: the real controller, fed simulated measurements."""

    def __init__(
        self,
        name: str,
        *,
        model: ModelConfig,
        profile: HardwareProfile,
        settings: ControllerSettings,
        decision: DecisionSettings,
        snapshot_every: int,
    ) -> None:
        self.name, self.model, self.profile = name, model, profile
        self.settings, self.decision = runtime_settings(settings), decision
        self.writes = SwitchWrites(self.settings.switch_recovery, self.settings.verify_transitions)
        self.checkpoint_every = snapshot_every
        self.state: ControllerState | None = None
        self.plan: GlobalPlan | None = None
        self.timings: list[StageTiming] = []
        self.last: TransitionTiming | None = None
        self.probes: tuple[ProbeTiming, ...] = ()  # the last decision's probes, answered by the world
        self.probe_world, self.probe_groups = 0, set()  # the probes' groups built in this world

    def _decide(self, observation: Observation, world: World, k: int) -> tuple[Decision, float, float]:
        assert self.state is not None
        started = time.perf_counter()
        d = decide(observation, self.state)
        wall = time.perf_counter() - started
        charged = wall if self.decision.cost == "measured" else self.decision.seconds
        self.state = d.state
        self.probes = probes.answer(world, k, d.probes)  # timed now, seen by the next decision
        if int(world.trace.devices[k]) != self.probe_world:  # a new world: the probes' groups are gone
            self.probe_world, self.probe_groups = int(world.trace.devices[k]), set()
        charged += probes.charged_s(world, self.probes, self.probe_groups)
        return d, charged, wall

    def begin(self, world: World) -> Move:
        tr = world.trace
        self.state = ControllerState.initial(
            models_for(self.model), self.profile, self.settings, stages=world.stages
        )
        d, charged, wall = self._decide(first_observation(world), world, 0)
        if d.plan is None:
            raise SimError(f"trace {tr.name}: no plan fits at step 0: {d.reason}")
        self.plan = d.plan
        return Move(self.plan, "start", decide_s=charged, decide_wall_s=wall, decide_calls=1, reason=d.reason)

    def prepare(self, k: int, world: World) -> Prepared:
        assert self.plan is not None
        usable = usable_bytes(world.trace.memory_bytes(k), self.settings.headroom)
        work = world.trace.workloads[k]
        recompute = features.activation_recompute(self.model)
        return Prepared(*world.run_plan(self.plan, work, usable, recompute=recompute))

    def predict(self, plan: GlobalPlan, work: Workload, world: World, k: int) -> float:
        """The calibrated cost model's step time for this step, from what it has seen before it
        (the controller's ``evaluate_plan`` on its state)."""
        assert self.state is not None
        usable = usable_bytes(world.trace.memory_bytes(k), self.settings.headroom)
        return evaluate_plan(plan, work, self.state, usable).step_s

    def after(self, k: int, world: World, run: StepRun) -> Move:
        assert self.plan is not None
        tr = world.trace
        self.timings += [
            StageTiming(stage=s, layout=run.plan.layouts[s], seconds=t, workload=run.work)
            for s, t in run.measured.items()
        ]
        nxt = k + 1
        if nxt >= tr.steps:
            return Move(self.plan)
        changed = tr.devices[nxt] != tr.devices[k] or tr.capacity_gb[nxt] != tr.capacity_gb[k]
        if not changed and nxt % self.decision.every:
            return Move(self.plan)
        obs = Observation(
            step=k,
            remaining_steps=tr.steps - nxt,
            devices=int(tr.devices[nxt]),
            memory_per_device=tr.memory_bytes(nxt),
            workload=tr.expected(k, self.decision.length_window),
            timings=tuple(self.timings),
            transition=self.last,
            probes=self.probes,
        )
        d, charged, wall = self._decide(obs, world, k)
        self.timings, self.last = [], None
        if d.action == "none" or d.plan is None:
            return Move(
                self.plan, "none", decide_s=charged, decide_wall_s=wall, decide_calls=1, reason=d.reason
            )
        if d.action == "keep" or d.plan == self.plan:
            return Move(
                self.plan, "keep", decide_s=charged, decide_wall_s=wall, decide_calls=1, reason=d.reason
            )
        old, self.plan = self.plan, d.plan
        estimate = d.transition
        seconds = world.transition_s(k, old, self.plan, self.writes) if estimate is not None else 0.0
        if estimate is not None and seconds > 0 and not tr.unplanned_shrink(k):  # a restart: no move
            self.last = TransitionTiming(predicted=estimate, seconds=seconds)
        return Move(
            self.plan,
            "retune" if same_degrees(old, self.plan) else "switch",
            transition_s=seconds,
            predicted_transition_s=estimate.seconds if estimate is not None else 0.0,
            decide_s=charged,
            decide_wall_s=wall,
            decide_calls=1,
            reason=d.reason,
        )


def rescale(plan: GlobalPlan, old_devices: int, new_devices: int, batch: int) -> GlobalPlan:
    """``plan`` with every stage's slots (first slot and count) scaled by new/old devices, TP/PP kept and
    DP the largest degree that fits the scaled slots and divides the batch (pp, then tp, halves only
    when a single replica no longer fits); each layout's schedule, recomputation and sharding kept
    (a schedule only on a pipeline, sharding only without one)."""
    layouts = {}
    for stage, v in plan.layouts.items():
        first = v.devices[0] * new_devices // old_devices
        slots = max(1, min(new_devices - first, len(v.devices) * new_devices // old_devices))
        tp, pp = v.tp, v.pp
        while tp * pp > slots:
            if pp > 1:
                pp //= 2
            else:
                tp //= 2
        dp = largest_dp(batch, slots // (tp * pp))
        # the plan's memory choices kept where the new degrees allow them
        choices = {"schedule": v.schedule if pp > 1 else "gpipe", "recompute": v.recompute}
        choices["shard"] = v.shard if pp == 1 else "optimizer"
        layouts[stage] = Layout.contiguous(tp=tp, pp=pp, dp=dp, first=first).model_copy(update=choices)
    return GlobalPlan.model_construct(placement=plan.placement, layouts=layouts)


class FixedStrategy:
    """A plan fixed at the start; DP rescaled when the devices change; micro-batches re-picked in truth."""

    name: str
    writes: SwitchWrites | None = None  # what a rescale writes
    checkpoint_every: int | None = None  # steps between periodic checkpoints (None: charged none)
    recomputes: bool | None = None  # activation recomputation: None where nothing fits, else a flag

    def __init__(self, name: str, *, headroom: float) -> None:
        self.name, self.headroom = name, headroom
        self.base: GlobalPlan | None = None
        self.devices = 0

    def initial_plan(self, world: World) -> GlobalPlan:
        raise NotImplementedError

    def begin(self, world: World) -> Move:
        self.base = self.initial_plan(world)
        self.devices = int(world.trace.devices[0])
        return Move(self.base, "start")

    def prepare(self, k: int, world: World) -> Prepared:
        assert self.base is not None
        usable = usable_bytes(world.trace.memory_bytes(k), self.headroom)
        flags = None if self.recomputes is None else dict.fromkeys(self.base.layouts, self.recomputes)
        plan, _, seconds = world.tune(self.base, world.trace.workloads[k], usable, recompute=flags)
        return Prepared(plan, seconds)

    def predict(self, plan: GlobalPlan, work: Workload, world: World, k: int) -> float | None:
        return None

    def device_change(self, k: int, world: World) -> tuple[int, int] | None:
        """(devices before, after) when the trace's devices change after step ``k`` (now held), else
        None."""
        tr = world.trace
        if k + 1 >= tr.steps or tr.devices[k + 1] == self.devices:
            return None
        before, self.devices = self.devices, int(tr.devices[k + 1])
        return before, self.devices

    def after(self, k: int, world: World, run: StepRun) -> Move:
        assert self.base is not None
        change = self.device_change(k, world)
        if change is None:
            return Move(self.base)
        (before, new), batch = change, int(world.trace.batch[k + 1])
        old, self.base = self.base, rescale(self.base, before, new, batch)
        estimate = analytic_transition_cost(
            dict(old.layouts), dict(self.base.layouts), world.models, world.profile
        )
        return Move(
            self.base,
            "rescale",
            transition_s=world.transition_s(k, old, self.base, self.writes),
            predicted_transition_s=estimate.seconds,
            reason=f"devices {before} -> {new}: DP rescaled",
        )


class StaticStrategy(FixedStrategy):
    """The controller's first plan, kept; DP scaled with the devices."""

    def __init__(
        self,
        name: str,
        *,
        model: ModelConfig,
        profile: HardwareProfile,
        settings: ControllerSettings,
        snapshot_every: int,
    ) -> None:
        super().__init__(name, headroom=settings.headroom)
        self.model, self.profile, self.settings = model, profile, runtime_settings(settings)
        self.writes = SwitchWrites(self.settings.switch_recovery, self.settings.verify_transitions)
        self.checkpoint_every = snapshot_every
        self.recomputes = features.activation_recompute(model)

    def initial_plan(self, world: World) -> GlobalPlan:
        state = ControllerState.initial(
            models_for(self.model), self.profile, self.settings, stages=world.stages
        )
        d = decide(first_observation(world), state)
        if d.plan is None:
            raise SimError(f"trace {world.trace.name}: no plan fits at step 0: {d.reason}")
        return d.plan
