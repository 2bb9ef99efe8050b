"""What a global plan is: the model-stages, their layouts, the plan's id and the rules a plan must obey.

Boundary: plan topology only, the one owner of
- the typed model-stage (``ModelStage``: its model, its phase, whether it owns
  state or is an inference copy of a train stage);
- which model-stages a job has (``stages_for``; PPO all six, GRPO no critic) and, for any such
  set, which own state, which are copies and in what order they load;
- the plan id (``plan_id``: the same plan gets the same id in ``nereus plan``, a
  run's ``plans/`` and the controller);
- the default plan (``default_plan``: what the config leaves out);
- whether a plan can run (``problems``: config validation, the plan search and
  the controller all ask it).
How a plan's stages add up to a step time and memory is ``plan_estimate.py``;
which plan to run is ``controller.py``'s business. This module imports no config,
so the config can ask it.

Placement (of a global plan): ``colocated`` when every model-stage uses the same slots
(time-shared); ``phased`` when some phase (generation; the forward passes; the train stages)
runs its stages at once on disjoint slot groups; else ``disaggregated`` (generation | the rest).
Which stages run at once is ``phases``: the one owner of a plan's phases and slot groups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Any, Literal, Protocol

from pydantic import Field, model_validator

from nereus_core.frozen import Frozen
from nereus_core.layout import Layout

Placement = Literal["colocated", "disaggregated", "phased"]
Phase = Literal["generate", "infer", "train"]  # a part of a step; every model-stage runs in one
PHASES: tuple[Phase, ...] = ("generate", "infer", "train")  # a step's phases, in order
# The layout of each model-stage, by name: a global plan's layouts, as transitions and schedules take them.
StageLayouts = Mapping[str, Layout]
MODELS = ("actor", "critic", "reference", "reward")
VALUE_HEAD_MODELS = ("critic", "reward")  # the others keep the lm head


class ModelStage(StrEnum):
    """One model in one stage . A ``str``: plans keyed by it read and
    write as plain ``"actor/train"`` in YAML, JSON and Parquet."""

    ACTOR_GENERATE = "actor/generate"
    ACTOR_TRAIN = "actor/train"
    CRITIC_INFER = "critic/infer"
    CRITIC_TRAIN = "critic/train"
    REFERENCE_INFER = "reference/infer"
    REWARD_INFER = "reward/infer"

    @property
    def model(self) -> str:
        return self.value.partition("/")[0]

    @property
    def kind(self) -> Phase:
        """The phase this model-stage runs in (``generate``, ``infer`` or ``train``)."""
        return self.value.partition("/")[2]  # type: ignore[return-value]

    @property
    def trains(self) -> bool:
        return self.kind == "train"

    @property
    def copy_of(self) -> ModelStage | None:
        """The train stage whose weights this inference copy serves (synced after every step)."""
        return _COPY_SOURCES.get(self)

    @property
    def owns_state(self) -> bool:
        """True for the stages that hold a model's state (snapshotted, moved in transitions)."""
        return self.copy_of is None


_COPY_SOURCES = {
    ModelStage.ACTOR_GENERATE: ModelStage.ACTOR_TRAIN,
    ModelStage.CRITIC_INFER: ModelStage.CRITIC_TRAIN,
}
MODEL_STAGES: tuple[ModelStage, ...] = tuple(ModelStage)  # every model-stage there is
GENERATE = ModelStage.ACTOR_GENERATE


def stages_for(*, critic: bool, reference: bool, reward_model: bool) -> tuple[ModelStage, ...]:
    """The model-stages of a job, in ``MODEL_STAGES`` order: the actor's two always, the critic's
    two when advantages need values (PPO), the reference when a KL term is used, the reward model
    when scores come from one (not from a rule). The one place that decides which stages a job has;
    the config asks it (``NereusConfig.stages``) and every other part asks the config."""
    wanted = {ModelStage.ACTOR_GENERATE, ModelStage.ACTOR_TRAIN}
    if critic:
        wanted |= {ModelStage.CRITIC_INFER, ModelStage.CRITIC_TRAIN}
    if reference:
        wanted.add(ModelStage.REFERENCE_INFER)
    if reward_model:
        wanted.add(ModelStage.REWARD_INFER)
    return tuple(s for s in MODEL_STAGES if s in wanted)


PPO_STAGES: tuple[ModelStage, ...] = stages_for(critic=True, reference=True, reward_model=True)


def own_state(stages: Iterable[str]) -> tuple[ModelStage, ...]:
    """The stages of ``stages`` that hold a model's state (snapshotted, moved in transitions)."""
    return tuple(s for s in map(ModelStage, stages) if s.owns_state)


def copies(stages: Iterable[str]) -> dict[ModelStage, ModelStage]:
    """Inference copy -> the train stage it follows, for the copies among ``stages``."""
    return {s: _COPY_SOURCES[s] for s in map(ModelStage, stages) if s in _COPY_SOURCES}


def load_order(stages: Iterable[str]) -> tuple[ModelStage, ...]:
    """``stages`` in the order they are loaded: a copy after the stage it follows."""
    stages = tuple(stages)
    return (*own_state(stages), *copies(stages))


def state_stages(stages: Iterable[str]) -> dict[str, ModelStage]:
    """Model -> the stage of ``stages`` holding its state."""
    return {s.model: s for s in own_state(stages)}


def model_of(stage: str) -> str:
    """``'critic/train'`` -> ``'critic'`` (raises ``ValueError`` for anything else)."""
    return ModelStage(stage).model


class _HasHead(Protocol):
    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Any: ...


def models_for(model: Any) -> dict[str, Any]:
    """The four PPO models built from one model config: critic and reward carry a value head when
    the config knows heads (actor and reference keep the lm head)."""
    if "head" not in type(model).model_fields:
        return dict.fromkeys(MODELS, model)
    value = model.model_copy(update={"head": "value"})
    lm = model.model_copy(update={"head": "lm"})
    return {m: value if m in VALUE_HEAD_MODELS else lm for m in MODELS}


def plan_id(layouts: Mapping[str, Layout]) -> str:
    """Stable short id of a set of layouts (same layouts, same id, in any process and order)."""
    digest = hashlib.sha1()
    for stage in sorted(layouts):
        v = layouts[stage]
        # GPipe's ids, and those of layouts without recomputation, as they were
        extra = (".1f1b" if v.schedule == "1f1b" else "") + (".rc" if v.recompute else "")
        extra += ".z3" if v.shard == "full" else ""
        digest.update(f";{stage}=tp{v.tp}.pp{v.pp}.dp{v.dp}.m{v.micro_batches}{extra}@".encode())
        # consecutive slots by their range (converting 1,024 ints to text is slow)
        first, last = v.devices[0], v.devices[-1]
        contiguous = v.devices == tuple(range(first, last + 1))
        digest.update(f"{first}..{last}".encode() if contiguous else ",".join(map(str, v.devices)).encode())
    return "plan-" + digest.hexdigest()[:12]


def default_plan(given: Mapping[str, Layout], stages: Iterable[str]) -> dict[ModelStage, Layout]:
    """The job's ``stages`` with their layouts in ``given``, the ones it leaves out on slot 0 as one
    replica (tp=pp=dp=1), in ``stages`` order."""
    given = {ModelStage(s): layout for s, layout in given.items()}
    return {ModelStage(s): given.get(ModelStage(s), Layout.contiguous()) for s in stages}


def layouts_json(layouts: Mapping[str, Layout]) -> dict[str, Any]:
    """``{model-stage: layout}`` as plain JSON: a run's ``plans/PLAN_ID.json`` and its records."""
    return {str(k): v.model_dump(mode="json") for k, v in layouts.items()}


SlotGroup = tuple[str, ...]  # model-stages of one phase that share slots: they run one after another
OLD_LOGP = "actor/train:old-logp"  # the forward pass of actor/train in the forward-pass phase


def slot_groups(layouts: Mapping[str, Layout]) -> tuple[SlotGroup, ...]:
    """``layouts``' keys grouped so that keys sharing a slot (directly or through another) are in
    one slot group; groups in order of their first key, keys in ``layouts`` order. Groups use
    disjoint slots."""
    groups: list[tuple[list[str], set[int]]] = []
    for key, layout in layouts.items():
        mine = set(layout.devices)
        touching = [g for g in groups if g[1] & mine]
        keys = [k for g in touching for k in g[0]] + [key]
        groups = [g for g in groups if not g[1] & mine] + [(keys, mine.union(*(g[1] for g in touching)))]
    order = list(layouts)
    ordered = sorted((sorted(keys, key=order.index) for keys, _ in groups), key=lambda k: order.index(k[0]))
    return tuple(tuple(keys) for keys in ordered)


def phases(layouts: Mapping[str, Layout]) -> dict[Phase, tuple[SlotGroup, ...]]:
    """The plan's phases (``PHASES`` order, those it has), each as its ``slot_groups``, stages in
    ``MODEL_STAGES`` order. Slot groups of one phase use disjoint slots and run at once; a phase
    takes its slowest group's time and a group the sum of its stages' (``cost.plan_estimate.
    step_seconds``, and the runtime's step). The forward passes include the old log-probs on
    actor/train's slots (as the runtime runs them), so passes sharing those slots are one group."""
    out: dict[Phase, tuple[SlotGroup, ...]] = {}
    for kind in PHASES:
        members = {s: layouts[s] for s in MODEL_STAGES if s in layouts and s.kind == kind}
        if not members:
            continue
        if kind == "infer" and ModelStage.ACTOR_TRAIN in layouts:
            # The old log-probs are a forward pass of actor/train on its own slots, in this phase:
            # the passes it shares slots with wait for it (one group); it is timed within actor/train.
            grouped = slot_groups({OLD_LOGP: layouts[ModelStage.ACTOR_TRAIN], **members})
            out[kind] = tuple(g for g in (tuple(s for s in group if s != OLD_LOGP) for group in grouped) if g)
        else:
            out[kind] = slot_groups(members)
    return out


def generation_apart(layouts: Mapping[str, Layout]) -> bool:
    """Whether actor/generate's slots are disjoint from every other model-stage's (it can run
    while the rest of the step runs: the one-step-off-policy overlap)."""
    if GENERATE not in layouts:
        return False
    mine = set(layouts[GENERATE].devices)
    return all(not mine & set(v.devices) for s, v in layouts.items() if s != GENERATE)


def sync_colocated(train: Layout, generate: Layout) -> bool:
    """Whether the actor's weight sync is the colocated reshard (every generation slot holds a
    train shard: 3D-HybridEngine) rather than a send of whole shards to slots that hold none."""
    return set(generate.devices) <= set(train.devices)


def infer_placement(layouts: Mapping[str, Layout]) -> Placement:
    """colocated when every model-stage uses the same slots; phased when some phase has slot groups
    that run at once (``phases``); else disaggregated."""
    sets = {frozenset(layout.devices) for layout in layouts.values()}
    if len(sets) == 1:
        return "colocated"
    return "phased" if any(len(groups) > 1 for groups in phases(layouts).values()) else "disaggregated"


def slots_needed(layouts: Mapping[str, Layout]) -> int:
    """How many device slots ``layouts`` needs (its highest slot + 1)."""
    return 1 + max(max(layout.devices) for layout in layouts.values())


# ------------------------------------------------------------------------------------- the rules


@dataclass(frozen=True)
class PlanRules:
    """What a plan must fit: the models (per model, with their heads), the pool, the batch.

    Built from the config (``NereusConfig.plan_rules``) or the controller's state;
    ``problems`` is the one place that applies them."""

    models: Mapping[str, Any]  # model -> ModelConfig (tp_error, pp_error)
    devices: int
    batch: int
    mini_batches: int = 1


def stage_rows(stage: str, batch: int, mini_batches: int) -> int:
    """Sequences one optimizer step (train) or one pass (infer, generate) of ``stage`` sees: a train
    stage splits the step's batch into ``mini_batches``, so each of its replicas' micro-batches
    divides ``batch / mini_batches``."""
    return batch // mini_batches if ModelStage(stage).trains else batch


def layout_problems(stage: str, layout: Layout, rules: PlanRules) -> list[str]:
    """Why ``stage`` cannot run on ``layout`` under ``rules`` (empty if it can), prefixed by the stage."""
    stage = ModelStage(stage)
    model = rules.models[stage.model]
    whose = None if model == rules.models.get("actor") else stage.model  # a model of its own shapes
    checks = (model.tp_error(layout.tp, whose), model.pp_error(layout.pp, whose))
    out = [p for p in (*checks, layout.devices_error(rules.devices)) if p]
    if layout.shard == "full" and not stage.trains:
        out.append(
            "shard full splits a train stage's state over dp; this stage holds whole weights: shard optimizer"
        )
    if stage.trains and rules.batch % rules.mini_batches:
        out.append(f"batch {rules.batch} is not divisible by ppo.mini_batches={rules.mini_batches}")
    else:
        rows = stage_rows(stage, rules.batch, rules.mini_batches)
        if rows % (layout.dp * layout.micro_batches):
            what = "job.batch_size/ppo.mini_batches" if stage.trains else "job.batch_size"
            out.append(
                f"{what}={rows} is not divisible by dp*micro_batches={layout.dp * layout.micro_batches}; "
                "choose a batch size that is a multiple of it"
            )
    return [f"{stage}: {p}" for p in out]


def problems(layouts: Mapping[str, Layout], rules: PlanRules) -> list[str]:
    """Why the plan ``layouts`` cannot run under ``rules`` (empty if it can)."""
    return [p for stage, layout in layouts.items() for p in layout_problems(stage, layout, rules)]


# ------------------------------------------------------------------------------------ the plan


class GlobalPlan(Frozen):
    """Layouts of the job's model-stages (``stages_for``) and how they share the device slots."""

    placement: Placement = Field(description="colocated (all stages time-share slots) or disaggregated.")
    layouts: dict[ModelStage, Layout] = Field(description="Layout of each model-stage.")

    @model_validator(mode="after")
    def _check(self) -> GlobalPlan:
        if not self.layouts:
            raise ValueError(
                f"a plan needs at least one model-stage layout; valid: {', '.join(MODEL_STAGES)}"
            )
        return self

    @classmethod
    def of(cls, layouts: Mapping[str, Layout]) -> GlobalPlan:
        """The plan of ``layouts``, its placement inferred."""
        return cls(placement=infer_placement(layouts), layouts=dict(layouts))

    @cached_property
    def plan_id(self) -> str:
        return plan_id(self.layouts)

    def __hash__(self) -> int:
        return hash(self.plan_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GlobalPlan) and self.plan_id == other.plan_id

    @property
    def devices(self) -> tuple[int, ...]:
        """Every slot some model-stage uses, ascending."""
        return tuple(sorted({d for layout in self.layouts.values() for d in layout.devices}))

    def stages_on(self, device: int) -> list[str]:
        return [s for s, layout in self.layouts.items() if device in layout.devices]

    def describe(self) -> str:
        """One line, e.g. ``colocated | actor/generate tp2.pp1.dp2 m1 @0..3 | ...`` (@ first..last slot;
        `` 1f1b`` after the micro-batches of a 1F1B pipeline, `` recompute`` where a train stage
        recomputes, `` full`` where it shards its weights over dp)."""
        parts = [
            f"{s} tp{v.tp}.pp{v.pp}.dp{v.dp} m{v.micro_batches}{' 1f1b' if v.schedule == '1f1b' else ''}"
            f"{' recompute' if v.recompute else ''}{' full' if v.shard == 'full' else ''} "
            f"@{min(v.devices)}..{max(v.devices)}"
            for s, v in self.layouts.items()
        ]
        return " | ".join([self.placement, *parts])

    def as_json(self) -> dict[str, Any]:
        """``{model-stage: layout}`` as plain JSON (a run's ``plans/PLAN_ID.json``)."""
        return layouts_json(self.layouts)
