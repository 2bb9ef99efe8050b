"""verl and OpenRLHF as fixed-plan strategies, modelled from their documentation (verl's HybridFlow
placement, OpenRLHF's Ray placement).

Both keep one plan for the whole run (neither changes TP/PP while it runs), pay the
weight sync from the trainer to the rollout engine every step, and run through the
same engine and true cost as Nereus. How they run through time (launch-time flags, checkpoints, a
relaunch when devices change or memory runs out) is ``peers``. Their config is the fastest in the
world's true cost on what a user knows at launch (``PeerStrategy.launch_works``: step 0's workload;
candidates from the uncalibrated cost model's search, scored in truth), in their favour.

- ``verl`` (HybridFlow, ``main_ppo.py``): every role colocated in one slot group and
  time-shared, so a step is the sum of its stages plus the colocated reshard of the
  actor into the rollout layout (3D-HybridEngine; ``stage_cost.weight_sync_s``).
  Training and inference may use Megatron TP/PP (verl supports it), so their layouts
  are the best in truth of the controller's search's candidates, colocated only; the rollout
  is vLLM with a launch-time ``tensor_model_parallel_size`` and no pipeline.
- ``openrlhf`` (``train_ppo_ray.py``): vLLM engines of one TP size on their own GPUs;
  DeepSpeed ZeRO for the rest (data parallel, optional AutoTP with one TP size for all
  DeepSpeed models, no pipeline). Placements (its flags): ``separate`` (each model its
  own GPUs, the default), ``paired`` (actor+reference, critic+reward) and ``colocated``
  (all models and vLLM time-share every GPU). Slot-group sizes are powers of two. Weight sync
  after every update: NCCL broadcast into the vLLM ranks one parameter at a time
  (disaggregated; the per-tensor cost OpenRLHF's issue threads measure), CUDA IPC when colocated.
  Within a step: generation, then the inference stages, then training;
  models on different GPUs run those phases concurrently (OpenRLHF calls their Ray
  actors together), models sharing GPUs one after another, and groups idle otherwise.

``config: default`` replaces that choice by each one's documented example for an 8B model
(``DEFAULTS``): verl's ``ppo_trainer.yaml`` (one colocated slot group, FSDP, vLLM
``tensor_model_parallel_size: 2``) and OpenRLHF's README PPO command for Llama-3-8B
(``--colocate_all_models``, ``--vllm_tensor_parallel_size 2``, ZeRO-3); the train and forward
layouts take the smallest TP of 1, 2, 4, 8 whose plan fits every sampled step (FSDP/ZeRO-3 without
TP where that fits; verl's Megatron examples for 7B use TP4), the one choice left open.

Both hold their train and forward weights sharded over the data-parallel ranks (verl's FSDP,
OpenRLHF's ZeRO-3; ``World.sharded_weights``) on layouts without a pipeline (neither runs under
one; a pipeline layout is Megatron's, ZeRO-1), in memory only: the gathers' traffic is not
charged, in their favour (nor for Nereus's sharded layouts). Their candidate layouts still come from
the cost model's search and are then fitted in the world's memory.

OpenRLHF's weight sync is priced one tensor at a time where it broadcasts over NCCL (its
``_broadcast_to_vllm``; ``World.per_tensor_sync``, ``transitions.sync_s``), by CUDA IPC when
colocated.

Both place only the model-stages the job has (``World.stages``). For GRPO that is what
each does: verl builds the critic's worker group only for GAE advantages (``need_critic``
in its ``ray_trainer.py``) and the reference's only with a KL term (``Role.RefPolicy``
when ``use_kl_loss`` or ``use_kl_in_reward``), and keeps every role it builds colocated in
the one slot group; OpenRLHF creates the critic's Ray group only with ``--critic_pretrain``
(``train_ppo_ray.py``), so its groups (``SLOT_GROUPS``) lose the critic's and keep the others,
and with a rule reward (``--remote_rm_url`` naming a reward function) no reward model runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from nereus_core.config import Workload
from nereus_core.controller.decide import ControllerSettings
from nereus_core.controller.search import Searcher, SearchSpace
from nereus_core.cost.stage_cost import Scales
from nereus_core.layout import Layout
from nereus_core.plan import GENERATE, GlobalPlan, Placement
from nereus_core.sim.config import StrategySpec
from nereus_core.sim.loop import SimError
from nereus_core.sim.peers import PeerStrategy
from nereus_core.sim.splits import largest_dp, usable_bytes
from nereus_core.sim.world import World

INF = float("inf")
INFER = ("reference/infer", "reward/infer", "critic/infer")
TRAIN = ("actor/train", "critic/train")
SLOT_GROUPS: dict[str, dict[str, tuple[str, ...]]] = {
    "separate": {
        "G": (GENERATE,),
        "A": ("actor/train",),
        "C": ("critic/infer", "critic/train"),
        "R": ("reference/infer",),
        "W": ("reward/infer",),
    },
    "paired": {
        "G": (GENERATE,),
        "A": ("actor/train", "reference/infer"),
        "C": ("critic/infer", "critic/train", "reward/infer"),
    },
}
# Documented defaults (8B): vLLM TP of the rollout; the train and forward stages share the slot group.
DEFAULTS = {
    "verl": 2,  # verl/trainer/config/ppo_trainer.yaml: rollout.tensor_model_parallel_size 2
    "openrlhf": 2,  # OpenRLHF README, Llama-3-8B PPO: --vllm_tensor_parallel_size 2 --colocate_all_models
}


def job_slot_groups(placement: str, stages: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The slot groups of ``SLOT_GROUPS[placement]`` holding the job's ``stages``: each keeps only the
    job's stages, and a group left with none (GRPO's critic group) is not created."""
    groups = {p: tuple(s for s in held if s in stages) for p, held in SLOT_GROUPS[placement].items()}
    return {p: held for p, held in groups.items() if held}


def oracle_seconds(world: World, plan: GlobalPlan, works: Sequence[Workload], usable: float) -> float:
    """True seconds of ``plan`` over ``works`` with micro-batches re-picked per step; inf if it ever
    does not fit."""
    total, sync = 0.0, world.true_sync_s(plan)
    for work in works:
        _, fits, seconds = world.tune(plan, work, usable)
        if not fits:
            return INF
        total += world.step_s(plan, seconds, sync)
    return total


def default_plan(world: World, name: str, works: Sequence[Workload], usable: float) -> GlobalPlan:
    """``name``'s documented layout (``DEFAULTS``) on all the trace's first devices, colocated: the
    rollout at its vLLM TP, every other stage at the smallest TP that fits every sampled step."""
    n, batch = int(world.trace.devices[0]), works[0].batch
    vllm_tp = min(DEFAULTS[name], n)
    gen = Layout.contiguous(tp=vllm_tp, dp=largest_dp(batch, n // vllm_tp))
    for tp in tp_options(world, n):
        layouts = {s: Layout.contiguous(tp=tp, dp=largest_dp(batch, n // tp)) for s in world.stages}
        plan = GlobalPlan.model_construct(placement="colocated", layouts={**layouts, GENERATE: gen})
        if oracle_seconds(world, plan, works, usable) < INF:
            return plan
    raise SimError(f"trace {world.trace.name}: {name}-default: no TP of {tp_options(world, n)} fits")


def tp_options(world: World, limit: int) -> list[int]:
    """Tensor-parallel sizes within a node that shard every model."""
    out = []
    for tp in (1, 2, 4, 8, 16, 32, 64):
        if tp <= min(limit, world.profile.devices_per_node) and all(
            m.tp_error(tp) is None for m in world.models.values()
        ):
            out.append(tp)
    return out


class VerlStrategy(PeerStrategy):
    """verl: one colocated plan, the best the true cost finds at launch; rollout TP only."""

    framework = "verl"

    def __init__(self, name: str, *, spec: StrategySpec, settings: ControllerSettings) -> None:
        super().__init__(name, spec=spec, headroom=settings.headroom)
        self.settings = settings

    def initial_plan(self, world: World) -> GlobalPlan:
        tr = world.trace
        n = int(tr.devices[0])
        usable = usable_bytes(tr.memory_bytes(0), self.headroom)
        works = self.launch_works(world, self.spec.tune_steps)
        world.sharded_weights = True  # FSDP full shard: ppo_trainer.yaml's actor, critic and ref strategy
        world.one_f_one_b = True  # a pipeline is Megatron's, on its default schedule
        if self.spec.config == "default":
            return default_plan(world, "verl", works, usable)
        by_length = sorted(works, key=lambda w: w.response_mean)
        picks = {by_length[int(q * (len(by_length) - 1))] for q in (0.0, 0.5, 0.9, 1.0)}
        space = SearchSpace(
            devices=n,
            budget=float(usable),
            disaggregated=False,
            phased=False,
            overlap=False,
            buckets=self.settings.memory_buckets,
        )
        candidates: dict[str, GlobalPlan] = {}
        for work in sorted(picks, key=lambda w: w.response_mean):
            found = Searcher(space, work, world.models, world.profile, Scales(), stages=world.stages).run()
            for f in found.feasible[:3]:
                for plan in self._rollout_variants(world, f.plan, n, work.batch):
                    candidates.setdefault(plan.plan_id, plan)
        if not candidates:
            raise SimError(f"trace {tr.name}: verl: no colocated plan fits on {n} devices")
        scored = {pid: oracle_seconds(world, p, works, usable) for pid, p in sorted(candidates.items())}
        best = min(scored, key=lambda pid: scored[pid])
        if scored[best] == INF:
            raise SimError(f"trace {tr.name}: verl: no colocated plan fits every sampled step")
        return candidates[best]

    def _rollout_variants(self, world: World, plan: GlobalPlan, n: int, batch: int) -> list[GlobalPlan]:
        """The plan with its rollout on each vLLM TP size (pp 1, data parallel over all devices)."""
        out = []
        for tp in tp_options(world, n):
            gen = Layout.contiguous(tp=tp, dp=largest_dp(batch, n // tp))
            out.append(
                GlobalPlan.model_construct(placement="colocated", layouts={**plan.layouts, GENERATE: gen})
            )
        return out


class OpenRLHFStrategy(PeerStrategy):
    """OpenRLHF: models on their own slot groups (or its colocation flags), the fastest config at
    launch."""

    framework = "openrlhf"

    def __init__(self, name: str, *, spec: StrategySpec, settings: ControllerSettings) -> None:
        super().__init__(name, spec=spec, headroom=settings.headroom)

    def initial_plan(self, world: World) -> GlobalPlan:
        tr = world.trace
        n = int(tr.devices[0])
        usable = usable_bytes(tr.memory_bytes(0), self.headroom)
        works = self.launch_works(world, self.spec.tune_steps)
        world.per_tensor_sync = True  # _broadcast_to_vllm: one NCCL broadcast per parameter
        world.sharded_weights = True  # ZeRO-3: its README's 8B PPO command (--zero_stage 3)
        world.one_f_one_b = True  # DeepSpeed's pipeline engine runs 1F1B
        if self.spec.config == "default":
            return default_plan(world, "openrlhf", works, usable)
        best: tuple[float, GlobalPlan] | None = None
        for placement in self.spec.placements:
            found = (
                self._colocated(world, n, works, usable)
                if placement == "colocated"
                else self._grouped(world, job_slot_groups(placement, world.stages), n, works, usable)
            )
            if found is not None and (best is None or found[0] < best[0]):
                best = found
        if best is None or best[0] == INF:
            raise SimError(
                f"trace {tr.name}: openrlhf: no config of {list(self.spec.placements)} fits on {n} devices"
            )
        return best[1]

    def _colocated(
        self, world: World, n: int, works: list[Workload], usable: float
    ) -> tuple[float, GlobalPlan]:
        batch, best = works[0].batch, (INF, None)
        for vllm_tp, ds_tp in itertools.product(tp_options(world, n), repeat=2):
            layouts = {s: Layout.contiguous(tp=ds_tp, dp=largest_dp(batch, n // ds_tp)) for s in world.stages}
            layouts[GENERATE] = Layout.contiguous(tp=vllm_tp, dp=largest_dp(batch, n // vllm_tp))
            plan = GlobalPlan.model_construct(placement="colocated", layouts=layouts)
            seconds = oracle_seconds(world, plan, works, usable)
            if seconds < best[0]:
                best = (seconds, plan)
        return best  # type: ignore[return-value]

    def _group_seconds(
        self, world: World, stages: tuple[str, ...], size: int, tp: int, works: list[Workload], usable: float
    ) -> dict[str, np.ndarray]:
        """True seconds per sampled step of each stage of one slot group of ``size`` GPUs (inf: does
        not fit)."""
        batch = works[0].batch
        layouts = {s: Layout.contiguous(tp=tp, dp=largest_dp(batch, size // tp)) for s in stages}
        plan = GlobalPlan.model_construct(placement="disaggregated", layouts=layouts)
        out = {s: np.full(len(works), INF) for s in stages}
        for i, work in enumerate(works):
            _, fits, seconds = world.tune(plan, work, usable)
            if fits:
                for s in stages:
                    out[s][i] = seconds[s]
        return out

    def _grouped(
        self, world: World, groups: dict[str, tuple[str, ...]], n: int, works: list[Workload], usable: float
    ) -> tuple[float, GlobalPlan] | None:
        sizes = [2**i for i in range(12) if max(1, n // 64) <= 2**i <= n // 2]
        if not sizes:
            return None
        gen, gen_tp = self._generation(world, sizes, n, works, usable)
        others = [p for p in groups if p != "G"]
        best: tuple[float, dict[str, int], int] | None = None
        for ds_tp in tp_options(world, n):
            table = {
                (p, size): self._group_seconds(world, groups[p], size, ds_tp, works, usable)
                for p in others
                for size in sizes
                if ds_tp <= size
            }
            for combo in itertools.product(sizes, repeat=len(groups)):
                if sum(combo) > n or ds_tp > min(combo[1:]):
                    continue
                chosen = dict(zip(["G", *others], combo, strict=True))
                per_stage = {s: table[(p, chosen[p])][s] for p in others for s in groups[p]}
                infer = _phase(per_stage, groups, INFER, others)
                train = _phase(per_stage, groups, TRAIN, others)
                total = float((gen[chosen["G"]] + infer + train).sum())
                if best is None or total < best[0]:
                    best = (total, chosen, ds_tp)
        if best is None or best[0] == INF:
            return None
        total, chosen, ds_tp = best
        return total, self._assemble(world, groups, chosen, gen_tp[chosen["G"]], ds_tp, works[0].batch)

    def _generation(
        self, world: World, sizes: list[int], n: int, works: list[Workload], usable: float
    ) -> tuple[dict[int, np.ndarray], dict[int, int]]:
        """Per generation slot-group size: seconds per sampled step (with the sync into it) at its
        best vLLM TP."""
        best: dict[int, np.ndarray] = {}
        best_tp: dict[int, int] = {}
        for g, tp in itertools.product(sizes, tp_options(world, n)):
            if tp > g:
                continue
            seconds = self._group_seconds(world, (GENERATE,), g, tp, works, usable)[GENERATE]
            # The sync target: a trainer on the next slot group (inter-node beyond one node).
            train = Layout.contiguous(first=g % n)
            two = GlobalPlan.model_construct(
                placement="disaggregated",
                layouts={GENERATE: Layout.contiguous(tp=tp, dp=g // tp), "actor/train": train},
            )
            seconds = seconds + world.true_sync_s(two)
            if g not in best or seconds.sum() < best[g].sum():
                best[g], best_tp[g] = seconds, tp
        return best, best_tp

    def _assemble(
        self,
        world: World,
        groups: dict[str, tuple[str, ...]],
        sizes: dict[str, int],
        gen_tp: int,
        ds_tp: int,
        batch: int,
    ) -> GlobalPlan:
        """Slot groups on consecutive slots, largest first (each starts on a node boundary or inside
        one node)."""
        layouts: dict[str, Layout] = {}
        first = 0
        for p in sorted(groups, key=lambda q: (-sizes[q], q)):
            tp = gen_tp if p == "G" else ds_tp
            for s in groups[p]:
                layouts[s] = Layout.contiguous(tp=tp, dp=largest_dp(batch, sizes[p] // tp), first=first)
            first += sizes[p]
        placement: Placement = "disaggregated"
        return GlobalPlan.model_construct(placement=placement, layouts={s: layouts[s] for s in world.stages})


def _phase(
    per_stage: dict[str, np.ndarray],
    groups: dict[str, tuple[str, ...]],
    stages: tuple[str, ...],
    names: list[str],
) -> np.ndarray:
    """Per sampled step: the slowest slot group of a phase, each slot group summing its stages of that phase:
    ``World.step_s``'s rule on the plan ``_assemble`` builds, whose groups are these on disjoint slots,
    vectorised over the sampled steps (tests check the two agree)."""
    out = np.zeros_like(next(iter(per_stage.values())))
    for p in names:
        mine = [per_stage[s] for s in groups[p] if s in stages]
        if mine:
            out = np.maximum(out, np.sum(mine, axis=0))
    return out
