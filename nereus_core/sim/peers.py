"""How verl and OpenRLHF run a job through time: launch-time flags, periodic checkpoints, and a relaunch
when their devices change or a step runs out of memory. Their plans (``baselines``) sit on this.

- **Launch.** A config is chosen from what a user knows at launch (``StrategySpec.config``):
  ``launch`` (the default) is the fastest in truth on step 0's workload, the only step a user has
  seen; ``default`` is the documented example; ``hindsight`` (a what-if, not a peer as it runs) scores
  ``tune_steps`` steps spread over the whole trace.
- **Launch-time flags stay.** Activation recomputation per train stage: both documented examples turn
  gradient checkpointing on (verl ``examples/grpo_trainer/run_qwen2-7b.sh``
  ``actor_rollout_ref.model.enable_gradient_checkpointing=True``; OpenRLHF's README PPO command
  ``--gradient_checkpointing``), so ``default`` runs with it; ``launch`` turns it on where step 0
  needs it. Micro-batch sizes: OpenRLHF's ``--micro_train_batch_size`` and
  ``--micro_rollout_batch_size`` are fixed (``FIXED_MICRO``); verl re-picks its train and forward
  micro-batches by token budget (``use_dynamic_bsz``), in its favour. vLLM admits what its KV cache
  holds, for every strategy (``World.tune``'s generation waves).
- **Out of memory.** A step that does not fit with the launch flags fails: the loop charges the
  attempt, the restart and the steps since the last checkpoint (``loop``); the job is relaunched with
  what the docs advise, recomputation on and smaller micro-batches (OpenRLHF's README: "if an OOM
  occurs"; verl's performance-tuning guide): every train stage recomputing and, where micro-batch
  sizes are launch flags (OpenRLHF), each halved until the failing step fits.
- **Checkpoints.** Every ``StrategySpec.checkpoint_every`` steps (20 by default), written synchronously
  (``World.checkpoint_s``).
  verl's ``ppo_trainer.yaml`` (``trainer.save_freq: -1``) and OpenRLHF's ``--save_steps -1`` write none
  by default, which loses the whole run on an unplanned shrink; both are given the cadence of verl's
  GRPO example (``trainer.save_freq=20``), in their favour.
- **Devices change.** Neither changes its device count while it runs (``shared/reference/baselines.md``):
  the job stops and is launched again on the new count with the same script (``rescale``: TP and PP
  kept, DP scaled; its recompute flags kept, micro-batches re-picked for the last step seen). A planned
  change first writes a checkpoint; an unplanned shrink restarts from the last periodic one (the loop
  charges the steps since). The relaunch pays ``World.relaunch_s``: the checkpoint write when planned,
  a new engine and process groups, and every device's read of the checkpoint. Not charged, in their
  favour: Ray's and the processes' start, and that verl's FSDP checkpoints are tied to the world size
  (verl#2265: a conversion first).
"""

from __future__ import annotations

import numpy as np

from nereus_core.config import Workload
from nereus_core.cost.stage_cost import stage_kind
from nereus_core.plan import GlobalPlan
from nereus_core.sim.config import StrategySpec
from nereus_core.sim.loop import Move, Prepared, StepRun
from nereus_core.sim.splits import usable_bytes
from nereus_core.sim.strategies import FixedStrategy, rescale
from nereus_core.sim.world import World

FIXED_MICRO = {"verl": False, "openrlhf": True}  # micro-batch sizes fixed at launch (OpenRLHF's flags)


def sample_steps(steps: int, count: int) -> list[int]:
    """``count`` steps spread evenly over a run (first and last included)."""
    return sorted({round(float(x)) for x in np.linspace(0, steps - 1, min(count, steps))})


def _halved(plan: GlobalPlan, stages: frozenset[str], batch: int) -> GlobalPlan:
    """``plan`` with the micro-batch size of each of ``stages`` halved (twice the micro-batches) where
    its replica's batch still splits evenly."""
    layouts = dict(plan.layouts)
    for s in stages:
        v = layouts[s]
        if (batch // v.dp) % (2 * v.micro_batches) == 0:
            layouts[s] = v.model_copy(update={"micro_batches": 2 * v.micro_batches})
    return GlobalPlan.model_construct(placement=plan.placement, layouts=layouts)


class PeerStrategy(FixedStrategy):
    """A peer framework as it runs: a plan chosen at launch (``initial_plan``), launch flags kept, a
    relaunch when its devices change or a step does not fit."""

    framework: str  # "verl" or "openrlhf"

    def __init__(self, name: str, *, spec: StrategySpec, headroom: float) -> None:
        super().__init__(name, headroom=headroom)
        self.spec = spec
        self.checkpoint_every = spec.checkpoint_every
        self.recompute: dict[str, bool] = {}  # the launch flag of each train stage

    def launch_works(self, world: World, count: int) -> list[Workload]:
        """The workloads the launch config is chosen on: step 0's, or with ``hindsight`` ``count`` steps
        spread over the whole trace."""
        tr = world.trace
        steps = sample_steps(tr.steps, count) if self.spec.config == "hindsight" else [0]
        return [tr.workloads[i] for i in steps]

    def _keep(self, plan: GlobalPlan) -> frozenset[str]:
        if not FIXED_MICRO[self.framework]:
            return frozenset()
        return frozenset(s for s in plan.layouts if stage_kind(s) != "generate")

    def _launch(self, world: World, plan: GlobalPlan, k: int) -> GlobalPlan:
        """``plan`` with its launch flags set for step ``k``'s workload: micro-batches the fastest that
        fit, recomputation where the flags say (``default``: every train stage) or where nothing fits."""
        tr = world.trace
        if self.spec.config == "default":
            self.recompute = {s: True for s in plan.layouts if stage_kind(s) == "train"}
        flags = {s: True for s, on in self.recompute.items() if on}
        usable = usable_bytes(tr.memory_bytes(k), self.headroom)
        tuned, _, _ = world.tune(plan, tr.workloads[k], usable, recompute=flags)
        self.recompute = {s: s in world.recomputed for s in plan.layouts if stage_kind(s) == "train"}
        return tuned

    def begin(self, world: World) -> Move:
        self.base = self._launch(world, self.initial_plan(world), 0)
        self.devices = int(world.trace.devices[0])
        return Move(self.base, "start")

    def prepare(self, k: int, world: World) -> Prepared:
        assert self.base is not None
        usable = usable_bytes(world.trace.memory_bytes(k), self.headroom)
        work, keep = world.trace.workloads[k], self._keep(self.base)
        plan, fits, seconds = world.tune(self.base, work, usable, recompute=self.recompute, keep=keep)
        if fits:
            return Prepared(plan, seconds)
        # Out of memory with the launch flags: relaunched with recomputation on and, where micro-batch
        # sizes are launch flags, each halved until the step fits (what the docs advise after an OOM).
        self.recompute = dict.fromkeys(self.recompute, True)
        base = self.base
        plan, fits, seconds = world.tune(base, work, usable, recompute=self.recompute, keep=keep)
        while not fits and _halved(base, keep, work.batch) != base:
            base = _halved(base, keep, work.batch)
            plan, fits, seconds = world.tune(base, work, usable, recompute=self.recompute, keep=keep)
        self.base = plan
        return Prepared(plan, seconds, failed=True)

    def after(self, k: int, world: World, run: StepRun) -> Move:
        assert self.base is not None
        change = self.device_change(k, world)
        if change is None:
            return Move(self.base)
        (before, new), old = change, self.base
        self.base = self._launch(world, rescale(old, before, new, int(world.trace.batch[k + 1])), k)
        unplanned = world.trace.unplanned_shrink(k)
        seconds = world.relaunch_s(k, self.base, None if unplanned else old)
        how = "lost: restarted from its last checkpoint" if unplanned else "checkpoint, restart"
        return Move(self.base, "relaunch", transition_s=seconds, reason=f"devices {before} -> {new}: {how}")
