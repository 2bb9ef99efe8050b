"""The simulated world: the true time of every stage, weight sync, transition and step, and what fits.

Boundary: the only place that knows the truth, and it imports nothing from the cost model or the
controller (``tests/core/sim/test_world_apart.py``), so comparing the two can show the cost model
wrong. A stage's true time comes from the stage-time world model (``stage_world``, fitted to published
runs, with constants per model size: ``stage_world.constants_for``), run on the sequences of that step:
their response lengths are drawn once per (seed, step) from the trace's mean, p90 and max, so every
strategy of one (trace, seed) meets the same sequences and the same noise (common random numbers: their
differences are not luck). What a job *measures* is the true time times seeded per-stage, per-step
noise; strategies see only measured times (``measured_stage_s``). What fits is the world's own memory
(``memory``, fitted to published peaks); a step combines its stages by the world's own rule
(``step_s``); transitions, restarts and the weight sync are the world's (``transitions``), and so are
checkpoints, recovery points and rehydration (``checkpoints``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import NamedTuple, Protocol

import numpy as np

from nereus_core.config import ModelConfig
from nereus_core.layout import Layout
from nereus_core.plan import (
    GENERATE,
    MODEL_STAGES,
    PPO_STAGES,
    GlobalPlan,
    ModelStage,
    model_of,
    models_for,
    sync_colocated,
)
from nereus_core.sim import checkpoints, memory, stage_world, transitions
from nereus_core.sim.checkpoints import SwitchWrites
from nereus_core.sim.noise import NoiseSettings
from nereus_core.sim.shapes import model_size, weight_tensors
from nereus_core.sim.splits import micro_batch_options
from nereus_core.sim.trace import Trace


class Device(Protocol):
    """What the world reads of the job's hardware profile: the datasheet, nothing the cost model fits."""

    name: str
    peak_flops: float
    memory_bandwidth: float
    devices_per_node: int
    max_generate_waves: int


class StepWork(Hashable, Protocol):
    """What the world reads of a step's workload (the trace's, ``Trace.workloads``)."""

    batch: int
    prompt_len: int
    ppo_epochs: int


SYNC = len(MODEL_STAGES)  # noise column of the weight sync


class StageEval(NamedTuple):
    """One model-stage on one layout for one step: true seconds, bytes per device (``memory.Held``)."""

    seconds: float
    persistent: float
    transient: float


class World:
    """One (trace, seed) of a job whose model-stages are ``stages`` (``SimConfig.stages``; default a PPO
    job's): the sequences of every step, the noise, and the true cost of anything run. Strategies plan
    ``stages`` and nothing else, so only those are ever timed.

    What the job's frameworks do, set by its strategy: ``sharded_weights`` (verl's FSDP, OpenRLHF's
    ZeRO-3 shard train and forward weights over the data-parallel ranks of a layout without a
    pipeline: neither FSDP nor ZeRO-3 runs under one, so a peer's pipeline is Megatron's, whose
    distributed optimizer shards only the optimizer state; Nereus shards a train layout's where the
    layout says, ``Layout.shard``), ``per_tensor_sync`` (OpenRLHF broadcasts weights
    one tensor at a time), ``one_f_one_b`` (the peers' Megatron pipeline schedule; Nereus runs a
    layout's own, ``Layout.schedule``). ``cuda_graphs``: the rollout
    engine's mode, the same for every strategy: off (eager, vLLM's ``enforce_eager``), the default of
    verl and of Nereus's rollout config; no sim config sets it yet."""

    def __init__(
        self,
        trace: Trace,
        model: ModelConfig,
        profile: Device,
        noise: NoiseSettings,
        seed: int,
        *,
        stages: tuple[ModelStage, ...] = PPO_STAGES,
        cuda_graphs: bool = False,
    ) -> None:
        self.trace, self.profile, self.seed, self.stages = trace, profile, seed, stages
        self.models = {m: v for m, v in models_for(model).items() if m in {model_of(s) for s in stages}}
        self.sizes = {name: model_size(m) for name, m in self.models.items()}
        self.params = {name: size.params for name, size in self.sizes.items()}
        # What a switch moves of each model-stage: its state where it owns the model's, else a bf16 copy.
        self.stage_bytes = {
            s: checkpoints.state_bytes(s, self.params[model_of(s)])
            if ModelStage(s).owns_state
            else checkpoints.FROZEN_BYTES_PER_PARAM * self.params[model_of(s)]
            for s in stages
        }
        self.constants = stage_world.constants_for(self.sizes["actor"].params)
        self.cuda_graphs = cuda_graphs
        self.per_tensor_sync = False
        self.sharded_weights = False
        self.one_f_one_b = False
        # One noise column per model-stage there is (and the sync), whichever the job has: a stage meets
        # the same noise in a PPO and a GRPO run of one (trace, seed).
        rng = np.random.default_rng([seed, 20_260_117])
        self.stage_noise = np.exp(rng.normal(0.0, noise.stage_sigma, size=(trace.steps, SYNC + 1)))
        self.transition_noise = np.exp(rng.normal(0.0, noise.transition_sigma, size=trace.steps))
        self._step_of = {w: k for k, w in reversed(list(enumerate(trace.workloads)))}
        self._lengths: dict[int, np.ndarray] = {}
        self._truth: dict[tuple, float] = {}
        self._evals: dict[tuple, StageEval] = {}
        self.k = 0
        self.recomputed: set[str] = set()  # the train stages the last ``tune`` ran with recomputation

    @property
    def steps(self) -> int:
        return self.trace.steps

    # ---------------------------------------------------------------- the sequences and their time

    def lengths(self, k: int) -> np.ndarray:
        """Response length of every sequence of step ``k`` (drawn once per seed and step)."""
        found = self._lengths.get(k)
        if found is None:
            tr = self.trace
            stats = stage_world.StepStats(
                batch=int(tr.batch[k]),
                prompt_mean=float(tr.prompt_len[k]),
                response_mean=float(tr.response_mean[k]),
                response_max=int(tr.response_max[k]),
                response_p90=float(tr.response_p90[k]),
            )
            rng = np.random.default_rng([self.seed, k, 17])
            found = self._lengths[k] = stage_world.draw_lengths(
                stats, rng, self.constants.length_concentration
            )
        return found

    def _step(self, work: StepWork) -> int:
        return self.k if self.trace.workloads[self.k] == work else self._step_of.get(work, self.k)

    def _shape(self, layout: Layout) -> stage_world.Shape:
        per_node = self.profile.devices_per_node
        return stage_world.Shape(layout.tp, layout.pp, layout.dp, layout.micro_batches, per_node)

    def truth_s(self, stage: str, layout: Layout, work: StepWork, *, recompute: bool = False) -> float:
        """The world model's seconds of one stage on one layout for the step whose workload is ``work``
        (``recompute``: the strategy's launch flag; a layout may recompute on its own)."""
        recompute = recompute or layout.recompute
        k = self._step(work)
        key = (stage, layout.tp, layout.pp, layout.dp, layout.micro_batches, k, recompute)
        found = self._truth.get(key)
        if found is None:
            size, c, gpu = self.sizes[model_of(stage)], self.constants, self._gpu(k)
            shape, lengths, prompt = self._shape(layout), self.lengths(k), float(work.prompt_len)
            kind = ModelStage(stage).kind
            if kind == "generate":
                found = stage_world.generation_s(
                    lengths, prompt, size, gpu, c, shape, cuda_graphs=self.cuda_graphs
                )
            elif kind == "train":
                one = stage_world.pass_time_s(
                    lengths, prompt, size, gpu, c, shape, train=True, recompute=recompute
                )
                found = c.train_fixed_s + (one - c.train_fixed_s) * work.ppo_epochs
            else:
                found = stage_world.pass_time_s(lengths, prompt, size, gpu, c, shape, train=False)
            self._truth[key] = found
        return found

    # ---------------------------------------------------------------- memory

    def held(self, stage: str, layout: Layout, work: StepWork, *, recompute: bool = False) -> memory.Held:
        """Bytes one device of ``layout`` holds for ``stage`` at step ``work`` (``memory``)."""
        recompute = recompute or layout.recompute
        k, size, shape = self._step(work), self.sizes[model_of(stage)], self._shape(layout)
        lengths, prompt = self.lengths(k), float(work.prompt_len)
        kind = ModelStage(stage).kind
        if kind == "generate":
            return memory.generation_bytes(lengths, prompt, size, shape)
        return memory.pass_bytes(
            lengths,
            prompt,
            size,
            shape,
            train=kind == "train",
            recompute=recompute,
            sharded=(self.sharded_weights and layout.pp == 1) or layout.shard == "full",
            one_f_one_b=self.one_f_one_b or layout.schedule == "1f1b",
        )

    def stage(self, stage: str, layout: Layout, work: StepWork) -> StageEval:
        """One model-stage on one layout for one step (kept for the step, as strategies ask twice)."""
        key = self._eval_key(stage, layout, work)
        found = self._evals.get(key)
        if found is None:
            held = self.held(stage, layout, work)
            found = self._evals[key] = StageEval(self.truth_s(stage, layout, work), *held)
        return found

    def _eval_key(self, stage: str, layout: Layout, work: StepWork) -> tuple:
        """What a kept evaluation depends on (the frameworks' flags too: strategies set them)."""
        shape = (layout.tp, layout.pp, layout.dp, layout.micro_batches, layout.schedule, layout.recompute)
        shape = (*shape, layout.shard, layout.devices)
        return (stage, *shape, work, self.sharded_weights, self.one_f_one_b)

    def floor_s(self, k: int) -> dict[str, float]:
        """Seconds per phase of step ``k`` that no plan of any shape can beat in this world: generation
        pays its call and at least the longest response's decode iterations (that sequence's replica
        decodes them one after another); each pass phase pays one call and its FLOPs spread over every
        device at ``mfu`` with no bubble, imbalance or TP traffic (for disjoint pools, the slowest pool
        is at least the phase's total work over all devices); no weight sync, no memory limit. On-policy
        PPO runs the phases one after another."""
        c, gpu, n = self.constants, self._gpu(k), int(self.trace.devices[k])
        lengths, prompt, epochs = self.lengths(k), float(self.trace.prompt_len[k]), self.trace.ppo_epochs
        per_iteration = stage_world.decode_overhead_s(c, self.cuda_graphs)
        out = {"generate": c.generate_fixed_s + per_iteration * float(lengths.max())}
        for kind in ("infer", "train"):
            train, fixed = kind == "train", c.train_fixed_s if kind == "train" else c.infer_fixed_s
            work = 0.0  # device-seconds of the phase: one device running the whole batch
            for stage in (s for s in self.stages if ModelStage(s).kind == kind):
                size = self.sizes[model_of(stage)]
                one = stage_world.pass_time_s(lengths, prompt, size, gpu, c, stage_world.Shape(), train=train)
                work += (one - fixed) * (epochs if train else 1)
            out[kind] = fixed + work / n if work else 0.0
        return out

    def _gpu(self, k: int) -> stage_world.Gpu:
        """The profile's device as the world model reads it, with step ``k``'s memory."""
        p = self.profile
        return stage_world.Gpu(p.name, p.peak_flops, p.memory_bandwidth, float(self.trace.memory_bytes(k)))

    def begin_step(self, k: int = 0) -> None:
        """Start step ``k``: forget the evaluations of earlier steps (each step has its own workload)."""
        self.k = k
        self._evals.clear()
        self._truth = {key: v for key, v in self._truth.items() if key[5] >= k}

    def true_stage_s(self, stage: str, layout: Layout, work: StepWork) -> float:
        return self.stage(stage, layout, work).seconds

    def step_s(self, plan: GlobalPlan, stage_s: Mapping[str, float], sync_s: float) -> float:
        """A step's seconds from its stages' and the weight sync's, as the runtimes run them: generation,
        then the weight sync, then the forward passes, then the train stages, each phase starting when
        the one before has ended on every device; within a phase each stage starts once all its devices
        are free (its collectives span them) and holds them until it ends, stages in the job's order."""
        total = 0.0
        for kind in ("generate", "infer", "train"):
            free: dict[int, float] = {}
            for stage in (s for s in MODEL_STAGES if s in plan.layouts and ModelStage(s).kind == kind):
                devices = plan.layouts[stage].devices
                end = max(free.get(d, 0.0) for d in devices) + stage_s.get(stage, 0.0)
                free.update(dict.fromkeys(devices, end))
            total += max(free.values(), default=0.0)
            if kind == "generate":
                total += sync_s
        return total

    def measured_stage_s(self, k: int, stage: str, true_s: float) -> float:
        return true_s * float(self.stage_noise[k, MODEL_STAGES.index(stage)])

    # ---------------------------------------------------------------- sync, transitions, restarts

    def true_sync_s(self, plan: GlobalPlan) -> float:
        """The weight sync in truth (``transitions.sync_s``, the world's formula): the actor's bf16 weights
        over the link the sync crosses, at least the measured floor; one tensor at a time when the job's
        framework broadcasts that way (``per_tensor_sync``, set by its strategy)."""
        train, gen = plan.layouts.get("actor/train"), plan.layouts.get(GENERATE)
        if train is None or gen is None:
            return 0.0
        per_node = self.profile.devices_per_node
        nodes = {d // per_node for d in (*gen.devices, train.devices[0])}
        tensors = weight_tensors(self.models["actor"]) if self.per_tensor_sync else 0
        return transitions.sync_s(
            2.0 * self.sizes["actor"].params,
            colocated=sync_colocated(train, gen),
            cross_node=len(nodes) > 1,
            tensors=tensors,
        )

    def measured_sync_s(self, k: int, true_s: float) -> float:
        return true_s * float(self.stage_noise[k, SYNC])

    def transition_s(
        self, k: int, old: GlobalPlan, new: GlobalPlan, writes: SwitchWrites | None = None
    ) -> float:
        """What a move after step ``k`` takes here: the moved bytes at link speed (``transitions.moved_s``),
        the fixed costs and, on Nereus's runtime, what it ``writes`` (``checkpoints.switch_s``: its
        recovery point, and a read back when the device set changes after step ``k``)."""
        if self.trace.unplanned_shrink(k):  # the devices are gone: restart from the newest checkpoint
            return self.relaunch_s(k, new)
        a, b = dict(old.layouts), dict(new.layouts)
        wire = transitions.moved_s(a, b, self.stage_bytes, self.profile.devices_per_node)
        fixed = transitions.fixed_s(a, b, old.placement != new.placement)
        if writes is not None:
            durable = bool(self.trace.devices[min(k + 1, self.steps - 1)] != self.trace.devices[k])
            per_node = self.profile.devices_per_node
            fixed += checkpoints.switch_s(a, b, self.params, per_node, writes, durable=durable)
        return (wire + fixed) * float(self.transition_noise[k])

    def relaunch_s(self, k: int, new: GlobalPlan, old: GlobalPlan | None = None) -> float:
        """A job stopped after step ``k`` and started again on ``new``: a synchronous checkpoint of
        ``old`` first (when given), the new engine and process groups, and every device's read of the
        checkpoint (``checkpoints.read_s``)."""
        save = self.checkpoint_s(old) if old is not None else 0.0
        start = self.restart_s(new) + checkpoints.read_s(dict(new.layouts), self.params)
        return (save + start) * float(self.transition_noise[k])

    def checkpoint_s(self, plan: GlobalPlan) -> float:
        """A periodic checkpoint of ``plan``, written synchronously (``checkpoints.write_s``)."""
        return checkpoints.write_s(dict(plan.layouts), self.params, self.profile.devices_per_node)

    def restart_s(self, plan: GlobalPlan) -> float:
        """The fixed cost of restarting ``plan`` from its last checkpoint after a failed step."""
        return transitions.restart_s(dict(plan.layouts))

    # ---------------------------------------------------------------- memory and micro-batches

    def resident(self, plan: GlobalPlan, work: StepWork) -> dict[str, float]:
        """Per model-stage: the persistent bytes (weights, optimizer) of its busiest device, summed over
        every stage on that device; memory per device is that plus the largest transient."""
        per_stage = {s: self.stage(s, v, work).persistent for s, v in plan.layouts.items()}
        top = max(max(layout.devices) for layout in plan.layouts.values()) + 1
        on_device = np.zeros(top)
        for stage, layout in plan.layouts.items():
            on_device[np.asarray(layout.devices)] += per_stage[stage]
        return {s: float(on_device[np.asarray(v.devices)].max()) for s, v in plan.layouts.items()}

    def _choose(
        self,
        stage: str,
        layout: Layout,
        ms: list[int],
        work: StepWork,
        room: float,
        by_time: bool,
        recompute: bool | None = None,
    ) -> tuple[Layout, bool, bool]:
        """The micro-batch count of ``ms`` that fits ``room`` transient bytes (fastest in truth when
        ``by_time``, else the only one given); a train stage that fits with none turns on full activation
        recomputation at its time cost (``recompute`` None; True or False fixes it, a launch flag).
        Stored for ``stage()``. Returns the layout, whether it fits, and whether it recomputes."""
        train = ModelStage(stage).kind == "train"
        options = [layout.model_copy(update={"micro_batches": m}) for m in ms]

        def bytes_of(again: bool) -> tuple[np.ndarray, np.ndarray]:
            held = [self.held(stage, v, work, recompute=again) for v in options]
            return np.array([h.persistent for h in held]), np.array([h.transient for h in held])

        recompute_now = bool(recompute) and train
        persistent, transient = bytes_of(recompute_now)
        ok = transient <= room
        if recompute is None and train and not ok.any():
            recompute_now = True
            persistent, transient = bytes_of(True)
            ok = transient <= room
        secs = np.array(
            [self.truth_s(stage, v, work, recompute=recompute_now) if by_time else 0.0 for v in options]
        )
        i = int(np.argmin(np.where(ok, secs, np.inf))) if ok.any() else int(np.argmin(transient))
        if not by_time:
            secs[i] = self.truth_s(stage, options[i], work, recompute=recompute_now)
        chosen = options[i]
        self._evals[self._eval_key(stage, chosen, work)] = StageEval(
            float(secs[i]), float(persistent[i]), float(transient[i])
        )
        return chosen, bool(ok.any()), recompute_now

    def tune(
        self,
        plan: GlobalPlan,
        work: StepWork,
        usable: float,
        *,
        recompute: Mapping[str, bool] | None = None,
        keep: frozenset[str] = frozenset(),
    ) -> tuple[GlobalPlan, bool, dict[str, float]]:
        """The plan with each stage's micro-batch count (generation: waves) that runs fastest in truth
        while every device fits ``usable`` bytes; the degrees and devices stay. Returns the plan, whether
        it fits, and each stage's true seconds. When nothing fits, the least-memory choice is kept.
        Memory per device = resident + the largest transient of its stages, so stages choose independently.
        Launch flags a framework fixes: ``recompute`` per train stage (else recomputation turns on only
        where nothing fits) and the micro-batch counts of the stages in ``keep``. The stages that
        recompute are in ``self.recomputed``.
        """
        resident = self.resident(plan, work)
        layouts, fits = {}, True
        self.recomputed = set()
        for stage, layout in plan.layouts.items():
            ms = (
                [layout.micro_batches]
                if stage in keep
                else micro_batch_options(stage, layout, work.batch, self.profile.max_generate_waves)
            )
            flag = None if recompute is None else recompute.get(stage)
            room = usable - resident[stage]
            layouts[stage], ok, again = self._choose(stage, layout, ms, work, room, True, flag)
            if again:
                self.recomputed.add(stage)
            fits = fits and ok
        tuned = GlobalPlan.model_construct(placement=plan.placement, layouts=layouts)
        return tuned, fits, {s: self.stage(s, v, work).seconds for s, v in layouts.items()}

    def run_plan(
        self, plan: GlobalPlan, work: StepWork, usable: float, *, recompute: bool | None = None
    ) -> tuple[GlobalPlan, dict[str, float]]:
        """``plan`` as it runs, and each stage's true seconds on it: every stage's micro-batches kept,
        with the world's recomputation option where a train stage would not fit ``usable`` (or
        ``recompute``, a runtime's flag for every train stage), except generation's waves, which are
        the rollout engine's (it admits the sequences its KV budget holds, for every strategy alike)."""
        kept = frozenset(s for s in plan.layouts if s != GENERATE)
        flags = None if recompute is None else dict.fromkeys(kept, recompute)
        ran, _, seconds = self.tune(plan, work, usable, recompute=flags, keep=kept)
        return ran, seconds

    def peak_bytes(self, plan: GlobalPlan, work: StepWork) -> float:
        """Bytes on the busiest device of ``plan``: its resident bytes and its stages' largest transient."""
        resident = self.resident(plan, work)
        return max(resident[s] + self.stage(s, v, work).transient for s, v in plan.layouts.items())
