"""The PPO job's driver state and its rules: what to do after a step, when a switch commits, where to resume.

Boundary: pure (no Prefect, Dask or files). The flow (flows/job/rl_job.py) runs the
steps, the transitions and the checkpoints, and asks this module what follows:

    observation(state, step, ...)  -> what the controller sees after a step
    after_step(state, observation) -> Keep | Switch | Fail     (the controller decides; a Switch
                                      carries plan B and the move schedule it was priced on)
    commit(state, switch, status)  -> the state in force next  (the controller advances
                                      only when the switch committed)
    resume_point(record, journals, devices) -> where a restarted driver carries on

``JobState.controller`` is the controller's view of the plan that RUNS: a switch the
controller asks for is pending until the transition commits. A refused, aborted or
GTG-refused switch leaves the job and the controller on plan A, so the controller
may ask again after a later step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from nereus_core.config import ModelConfig, NereusConfig, ScenarioEvent, Workload
from nereus_core.controller.decide import (
    ControllerSettings,
    ControllerState,
    Decision,
    Observation,
    StageTiming,
    TransitionTiming,
    calibrated_on,
    decide,
)
from nereus_core.controller.moves import MoveSchedule
from nereus_core.controller.state import ProbeTiming
from nereus_core.controller.transition_schedule import JOB_CONTROLLER
from nereus_core.cost.hardware import get_profile
from nereus_core.engine.optimizer import OptimizerSettings
from nereus_core.layout import Layout
from nereus_core.plan import (
    GlobalPlan,
    ModelStage,
    copies,
    default_plan,
    problems,
    slots_needed,
)

SwitchStatus = Literal["committed", "aborted", "refused"]


@dataclass(frozen=True)
class JobState:
    """What the driver knows between steps. ``config`` is the job's config as it is now (scenario
    events change its devices and response length); ``plan`` is the plan in force; ``devices`` is the
    size of the device world in force (it differs from ``config.cluster.devices`` only while a device
    change is pending)."""

    config: NereusConfig
    plan: GlobalPlan
    devices: int
    controller: ControllerState
    last_transition: TransitionTiming | None = None
    probes: tuple[ProbeTiming, ...] = ()  # the last decision's probes, timed: the next one sees them

    @property
    def layouts(self) -> Mapping[ModelStage, Layout]:
        """The plan in force's layout of each model-stage (what the step runs on)."""
        return self.plan.layouts

    @property
    def plan_id(self) -> str:
        return self.plan.plan_id

    @property
    def aliased(self) -> frozenset[ModelStage]:
        """Inference copies on exactly their train stage's layout: they share its shards, no sync."""
        pairs = copies(self.layouts).items()
        return frozenset(c for c, source in pairs if self.layouts[c] == self.layouts[source])


@dataclass(frozen=True)
class Keep:
    """Stay on the plan in force."""

    reason: str


@dataclass(frozen=True)
class Switch:
    """Move to ``plan`` on ``devices`` slots; ``pending`` is the controller once it commits. ``moves``:
    the schedule the controller priced (a switch on the same devices), which the transition runs after
    re-checking the pool it assumed; None for a new world (every stage rehydrates from the checkpoint)."""

    plan: GlobalPlan
    devices: int
    reason: str
    decision: Decision = field(repr=False)
    pending: ControllerState = field(repr=False)
    moves: MoveSchedule | None = field(default=None, repr=False)

    @property
    def layouts(self) -> Mapping[ModelStage, Layout]:
        return self.plan.layouts

    @property
    def plan_id(self) -> str:
        return self.plan.plan_id


@dataclass(frozen=True)
class Fail:
    """The job cannot go on; ``reason`` says why and what would help."""

    reason: str


Outcome = Keep | Switch | Fail


def controller_settings(config: NereusConfig) -> ControllerSettings:
    """The controller's settings for a job of ``config`` (``nereus run`` and ``nereus plan`` alike):
    moves priced as the transition flow runs them, generation's engine (vLLM: no pipelined
    generation, a change of its layout rebuilds the engines), what a switch writes and verifies;
    only the features the runtime runs (``controller.features``: no overlap)."""
    from nereus_core.controller.features import runtime_settings

    job = config.job
    settings = JOB_CONTROLLER.model_copy(
        update={
            "rollout_engine": config.rollout.engine,
            "switch_recovery": job.switch_recovery,
            "verify_transitions": job.verify_transitions,
        }
    )
    return runtime_settings(settings)


def start(config: NereusConfig, layouts: Mapping[str, Layout] | None = None) -> JobState:
    """The state of a job starting on ``layouts`` (default: the config's plan, completed)."""
    plan = GlobalPlan.of(default_plan(config.plan if layouts is None else layouts, config.stages))
    devices = config.cluster.devices
    controller = ControllerState.initial(
        config.models,
        get_profile(config.job.profile),
        controller_settings(config),
        stages=config.stages,
        plan=plan,
        devices=devices,
    )
    return JobState(config=config, plan=plan, devices=devices, controller=controller)


def stage_timings(
    rows: Sequence[Mapping[str, Any]], layouts: Mapping[ModelStage, Layout]
) -> tuple[StageTiming, ...]:
    """The controller's timings from a step's rows (``model``, ``stage``, ``duration_s``): the rows
    of model-stages the cost model prices (not the old log-probs, the rule score, the advantages)."""
    out = []
    for r in rows:
        try:
            stage = ModelStage(f"{r['model']}/{r['stage']}")
        except ValueError:
            continue
        if r["duration_s"] > 0:
            out.append(StageTiming(stage=stage, layout=layouts[stage], seconds=r["duration_s"]))
    return tuple(out)


def observation(
    state: JobState,
    *,
    step: int,
    rows: Sequence[Mapping[str, Any]] = (),
    lengths: Sequence[int] = (),
    prompt_lengths: Sequence[int] = (),
    memory_peaks: Mapping[int, int] | None = None,
    ready_devices: int | None = None,
) -> Observation:
    """What the controller sees after ``step``: the step's stage timings, the response lengths it
    generated and its prompts' real lengths (the config's until there are some), the devices wanted,
    the memory peaks and the slots whose workers are started and warm (``ready_devices``; None:
    those in force)."""
    cfg = state.config
    return Observation(
        step=step,
        remaining_steps=max(cfg.job.steps - step - 1, 0),
        devices=cfg.cluster.devices,
        memory_per_device=int(cfg.cluster.memory_per_device),
        workload=Workload.from_config(cfg, lengths, prompt_lengths=prompt_lengths),
        timings=stage_timings(rows, state.layouts),
        memory_peaks=dict(memory_peaks or {}),
        transition=state.last_transition,
        probes=state.probes,
        ready_devices=ready_devices,
    )


def after_step(state: JobState, obs: Observation) -> tuple[Outcome, Decision, JobState]:
    """Ask the controller after a step. Returns the outcome, the decision behind it and the state
    in force until the outcome is carried out (a Keep advances the controller at once)."""
    decision = decide(obs, state.controller)
    state = replace(state, last_transition=None, probes=())
    if decision.action == "none":
        return Fail(f"{decision.reason}; give the job more devices or memory"), decision, state
    wanted = state.config.cluster.devices
    if decision.action == "switch" and decision.plan is not None:
        refused = problems(decision.plan.layouts, state.config.plan_rules(wanted))
        if not refused:
            moves = decision.moves if wanted == state.devices else None  # a new world has no moves
            return (
                Switch(decision.plan, wanted, decision.reason, decision, decision.state, moves),
                decision,
                state,
            )
        reason = f"the controller's plan is refused: {refused[0]}"
    else:
        reason = decision.reason
    if wanted != state.devices:  # the devices changed and the plan stays: the same plan in a new world
        pending = _not_switched(decision.state, state.controller).model_copy(update={"devices": wanted})
        return Switch(state.plan, wanted, reason, decision, pending), decision, state
    kept = _not_switched(decision.state, state.controller)
    return Keep(reason), decision, replace(state, controller=kept)


def commit(
    state: JobState, switch: Switch, status: SwitchStatus, timing: TransitionTiming | None = None
) -> JobState:
    """The state after ``switch`` ended with ``status``. Committed: plan B and the controller that
    chose it. Aborted or refused: plan A and the controller as it was (with the step's calibration),
    so it may try again; raises ``JobFailed`` when the device world had to change and could not."""
    if status == "committed":
        return replace(
            state,
            plan=switch.plan,
            devices=switch.devices,
            controller=switch.pending,
            last_transition=timing,
        )
    if switch.devices != state.devices:
        raise JobFailed(
            f"the device set changed ({state.devices} -> {switch.devices} slots) but the switch was {status}"
        )
    return replace(state, controller=_not_switched(switch.pending, state.controller))


class JobFailed(RuntimeError):
    """The job cannot continue; the message says why."""


def _not_switched(after: ControllerState, before: ControllerState) -> ControllerState:
    """``after`` (the controller's state once it decided) as if no switch happened: its calibration
    stays, its plan and devices are the ones in force, its dwell counts on."""
    return after.model_copy(
        update={
            "plan": before.plan,
            "devices": before.devices,
            "steps_since_switch": before.steps_since_switch + (1 if before.plan is not None else 0),
        }
    )


def apply_event(state: JobState, event: ScenarioEvent | None) -> tuple[JobState, list[str]]:
    """A scenario event before a step: the config's devices and/or response length change.
    Returns the new state and what changed (empty: nothing did)."""
    if event is None:
        return state, []
    cfg, what = state.config, []
    if event.devices is not None and event.devices != cfg.cluster.devices:
        what.append(f"devices {cfg.cluster.devices} -> {event.devices}")
        cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"devices": event.devices})})
    if event.response_len is not None and event.response_len != cfg.job.response_len:
        what.append(f"response length {cfg.job.response_len} -> {event.response_len}")
        cfg = cfg.model_copy(update={"job": cfg.job.model_copy(update={"response_len": event.response_len})})
    return replace(state, config=cfg), what


# ------------------------------------------------------------------------------------- resume


@dataclass(frozen=True)
class ResumePoint:
    """Where a restarted driver carries on: the checkpoint's step, the plan to rehydrate under, the
    devices, and what to do with each interrupted transition journal (``finish`` or ``roll_back``)."""

    step: int
    layouts: Mapping[ModelStage, Layout]
    devices: int
    checkpoint_devices: int
    response_len: int
    journals: Mapping[str, Literal["finish", "roll_back"]]

    @property
    def replan(self) -> bool:
        """Another number of devices than at the checkpoint, or a plan that needs more: re-plan."""
        return self.devices != self.checkpoint_devices or slots_needed(self.layouts) > self.devices


def resume_point(
    record: Mapping[str, Any], interrupted: Mapping[str, Mapping[str, Any]], devices: int | None
) -> ResumePoint:
    """From the newest checkpoint ``record`` (step, plan, devices, response_len) and the headers of
    the interrupted transitions (by journal name): a switch whose checkpoint is this one and whose
    plan B fits the devices is finished (plan B is rehydrated from the checkpoint); any other is
    rolled back (plan A, the checkpoint's)."""
    step, n = int(record["step"]), devices or int(record["devices"])
    layouts = {ModelStage(k): Layout.model_validate(v) for k, v in record["plan"].items()}
    verdicts: dict[str, Literal["finish", "roll_back"]] = {}
    for name, header in interrupted.items():
        target = {ModelStage(k): Layout.model_validate(v) for k, v in header.get("new", {}).items()}
        if header.get("checkpoint_step") == step and target and slots_needed(target) <= n:
            layouts, verdicts[name] = target, "finish"
        else:
            verdicts[name] = "roll_back"
    return ResumePoint(step, layouts, n, int(record["devices"]), int(record["response_len"]), verdicts)


def resumed_config(config: NereusConfig, point: ResumePoint) -> NereusConfig:
    """The job's config as it was at the checkpoint: its devices (or the ones given) and response length."""
    return config.model_copy(
        update={
            "cluster": config.cluster.model_copy(update={"devices": point.devices}),
            "job": config.job.model_copy(update={"response_len": point.response_len}),
        }
    )


def resume_start(point: ResumePoint | None) -> tuple[ResumePoint | None, int | None]:
    """Where a run starts and the devices it grows to once they are warm: a resume onto more devices
    than the checkpoint's starts on the checkpoint's (when its plan needs no more) and grows to the
    rest; anything else starts as asked."""
    if point is None or point.devices <= point.checkpoint_devices:
        return point, None
    if slots_needed(point.layouts) > point.checkpoint_devices:  # a finished switch needs the new devices
        return point, None
    return replace(point, devices=point.checkpoint_devices), point.devices


def resumed(
    config: NereusConfig, point: ResumePoint, transitions: Sequence[TransitionTiming] = ()
) -> JobState:
    """The job's state at ``point``: the config as it was at the checkpoint (devices, response length),
    the transition cost calibrated on the switches the job made (``transitions``, from its records)
    and, when the devices differ, the plan the controller picks for them. Raises ``JobFailed`` when
    no plan fits."""
    state = start(resumed_config(config, point), point.layouts)
    state = replace(state, controller=calibrated_on(state.controller, transitions))
    if not point.replan:
        return state
    # Start the controller on the checkpoint's devices: the change to the devices at hand forces a plan.
    state = replace(
        state, controller=state.controller.model_copy(update={"devices": point.checkpoint_devices})
    )
    decision = decide(observation(state, step=max(point.step - 1, 0)), state.controller)
    if decision.plan is None:
        raise JobFailed(f"resume on {point.devices} devices: {decision.reason}")
    return replace(state, plan=decision.plan, controller=decision.state)


# ------------------------------------------------------------------------- per model-stage settings


def model_config(config: NereusConfig, stage: str) -> ModelConfig:
    """The model config of a model-stage: critic and reward carry the value head."""
    return config.models[ModelStage(stage).model]


def optimizer_settings(config: NereusConfig, stage: str) -> OptimizerSettings | None:
    """AdamW settings of a train model-stage (None for an inference stage); ``ppo.grad_clip``
    clips actor and critic alike."""
    stage = ModelStage(stage)
    if not stage.trains:
        return None
    lr = config.ppo.actor_lr if stage.model == "actor" else config.ppo.critic_lr
    return OptimizerSettings(lr=lr, weight_decay=config.job.weight_decay, grad_clip=config.ppo.grad_clip)
