"""What the controller reads, carries and returns: its settings, an observation, its state, a decision.

Boundary: data only (frozen pydantic models). ``controller.decide`` reads an
``Observation`` and a ``ControllerState`` and returns a ``Decision``;
``admission.py`` holds the rules that pick the action and ``controller.history.py`` what
the controller remembers of the plans it ran. The job keeps the state between steps
and advances it only when a switch commits (nereus_core/job.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, InstanceOf, model_validator

from nereus_core.config import ModelConfig, NereusConfig, RecoveryMode, Workload
from nereus_core.controller.moves import MoveSchedule
from nereus_core.cost.calibration import CalibrationSettings, Sample
from nereus_core.cost.hardware import HardwareProfile
from nereus_core.cost.plan_estimate import PlanEstimate
from nereus_core.cost.stage_cost import Scales
from nereus_core.cost.transition_cost import TransitionEstimate, TransitionScales
from nereus_core.frozen import Frozen
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan, ModelStage


class ControllerSettings(Frozen):
    """When a plan change is admitted, and what the search may consider."""

    margin: float = Field(default=0.2, ge=0, le=100, description="Gain must beat (1 + margin) x cost.")
    min_gain: float = Field(
        default=0.015,
        ge=0,
        le=1,
        description="Smallest unforced gain per step, as a share of the current plan's step time, "
        "whatever the noise (gains of 1e-4 s on 20 s steps were admitted).",
    )
    min_tight_gain: float = Field(
        default=0.03,
        ge=0,
        le=1,
        description="Smallest gain per step for which a forced move takes a plan that fits the forecast "
        "only without choose_headroom, over the fastest plan that fits with it (a share of its step).",
    )
    min_measured_gain: float = Field(
        default=0.01,
        ge=0,
        le=1,
        description="Smallest unforced gain per step toward a plan that ran here on this workload "
        "(weighed by its own measurement, not the cost model's prediction), as a share of the step.",
    )
    noise_z: float = Field(
        default=2.0,
        ge=0,
        le=100,
        description="An unforced gain must also be at least this many times the relative standard "
        "deviation of the current plan's measured/predicted step times (its step-to-step noise), "
        "at least the noise pooled over every plan the job measured.",
    )
    horizon: int = Field(default=50, ge=1, le=1_000_000, description="Most future steps a gain is credited.")
    dwell: int = Field(default=3, ge=0, le=1_000_000, description="Fewest steps between unforced switches.")
    headroom: float = Field(default=0.1, ge=0, lt=1, description="Share of device memory kept free.")
    choose_headroom: float = Field(
        default=0.15,
        ge=0,
        lt=1,
        description="Further share of usable memory a newly chosen plan must leave free; the plan "
        "in force is checked without it (hysteresis: no forced move at every small growth).",
    )
    forecast_steps: int = Field(
        default=20,
        ge=0,
        le=100_000,
        description="Steps ahead the high response length is forecast (linear trend) when choosing "
        "a new plan's memory.",
    )
    forecast_window: int = Field(
        default=20, ge=2, le=10_000, description="Recent workloads the length trend is fitted to."
    )
    workload_margin: float = Field(
        default=0.2,
        ge=0,
        le=10,
        description="Relative change of the mean prompt and response lengths within which a plan's "
        "measured step time (and the verdict that it was slower) still holds.",
    )
    top_k: int = Field(default=8, ge=1, le=256, description="Fastest plans weighed against their cost.")
    disaggregated: bool = Field(default=True, description="Also consider generation on its own slots.")
    overlap_disaggregated: bool = Field(
        default=False,
        description="Disaggregated pools overlap steps (one-step off-policy); else they take turns.",
    )
    memory_buckets: int = Field(default=64, ge=8, le=4096, description="Memory resolution of the search.")
    transition_pricing: Literal["layouts", "schedule"] = Field(
        default="layouts",
        description="How a move is priced: from the layouts alone (``transition_cost``; the simulator), "
        "or from the GTG schedule the transition flow runs (``transition_schedule``; the job).",
    )
    rollout_engine: Literal["nereus", "vllm"] = Field(
        default="nereus",
        description="actor/generate's engine (``rollout.engine``): with vllm a change of its layout also "
        "rebuilds its engines, priced as the transition's engine term.",
    )
    switch_recovery: RecoveryMode = Field(
        default="async",
        description="What a switch writes before its moves (``job.switch_recovery``), priced as the "
        "transition's recovery term.",
    )
    verify_transitions: bool = Field(
        default=False,
        description="Whether a switch's live state is verified (``job.verify_transitions``), priced as "
        "the transition's verify term.",
    )
    max_alternatives: int = Field(default=5, ge=0, le=100, description="Rejected plans reported.")
    probe_every: int = Field(
        default=10,
        ge=0,
        le=1_000_000,
        description="Steps between probes of generation's TP collectives at every degree it may use "
        "(``controller.probe``; the plan in force shows only its own); 0: never.",
    )
    probe_iterations: int = Field(
        default=16, ge=1, le=10_000, description="Decode iterations whose collectives one probe times."
    )
    calibration: CalibrationSettings = CalibrationSettings()
    transition_calibration: CalibrationSettings | None = Field(
        default=None,
        description="How measured transitions refit the transition scales (None: as ``calibration``).",
    )


class StageTiming(Frozen):
    """How long one model-stage took in the last step, on which layout."""

    stage: ModelStage
    layout: Layout
    seconds: float = Field(gt=0)
    workload: Workload | None = Field(
        default=None, description="The step's workload if not the observation's."
    )


class ShapeSample(Frozen):
    """One stage timing kept by its shape (the model-stage, its tp and pp): the cost model's unscaled
    terms for it and the seconds it took (``history.shape_residuals``)."""

    shape: str
    raw: tuple[float, ...]
    seconds: float


class TransitionTiming(Frozen):
    """A transition that ran: what was predicted (unscaled terms inside) and how long it took."""

    predicted: TransitionEstimate
    seconds: float = Field(gt=0)


class ProbeRequest(Frozen):
    """A short timed probe the controller asks for (``controller.probe``): the TP collectives at degree
    ``tp``, on ``devices``, of ``iterations`` decode steps of one generation replica, or of as many
    micro-batch forwards of a pass stage."""

    stage: ModelStage
    tp: int = Field(ge=2, le=4096, description="The TP degree probed.")
    devices: tuple[int, ...] = Field(min_length=2, description="The tp slots the collectives run on.")
    batch: int = Field(
        ge=1,
        description="Rows of the buffer: sequences of one replica (generation) or "
        "of one micro-batch (a pass).",
    )
    iterations: int = Field(ge=1, description="Decode steps (generation) or micro-batch forwards timed.")
    seq: int = Field(default=1, ge=1, description="Tokens of each row per pass: 1 for a decode step.")

    @model_validator(mode="after")
    def _ranks(self) -> ProbeRequest:
        if len(self.devices) != self.tp:
            raise ValueError(f"{len(self.devices)} devices for a tp={self.tp} probe; give tp slots")
        return self


class ProbeTiming(Frozen):
    """A probe that ran and how long it took."""

    request: ProbeRequest
    seconds: float = Field(gt=0)


class Observation(Frozen):
    """What the job reports after a step."""

    step: int = Field(ge=0)
    remaining_steps: int = Field(ge=0, description="Steps still to run.")
    devices: int = Field(ge=1, description="Device slots available now (slots 0..devices-1).")
    memory_per_device: int = Field(gt=0, description="Capacity of one slot, bytes.")
    workload: Workload = Field(description="The workload expected next (e.g. recent response lengths).")
    timings: tuple[StageTiming, ...] = Field(
        default=(), description="Stage times measured since the last decision, on the plan in force."
    )
    memory_peaks: dict[int, int] = Field(default_factory=dict, description="Measured peak bytes per slot.")
    transition: TransitionTiming | None = None
    probes: tuple[ProbeTiming, ...] = Field(
        default=(), description="The probes the last decision asked for, timed."
    )
    ready_devices: int | None = Field(
        default=None,
        ge=1,
        description="Slots whose workers are started and warmed (a grow prepared ahead); None: "
        "the slots of the plan in force.",
    )

    @classmethod
    def before_start(cls, cfg: NereusConfig) -> Observation:
        """What the controller sees before a job's first step: the config's devices, memory and
        workload, no timings yet (``nereus plan`` and the preflight's reading of it)."""
        return cls(
            step=0,
            remaining_steps=cfg.job.steps,
            devices=cfg.cluster.devices,
            memory_per_device=int(cfg.cluster.memory_per_device),
            workload=Workload.from_config(cfg),
        )


class StepTerms(Frozen):
    """A measured step's prediction, unscaled, so that later calibrations re-price it."""

    raw: dict[str, tuple[float, ...]] = Field(
        description="Per model-stage, the cost model's unscaled term seconds (``stage_cost.TERMS`` order)."
    )
    sync_raw: float = Field(ge=0, description="Unscaled weight-sync seconds.")


class PlanRecord(Frozen):
    """What one plan measured when it ran (its stage times combined as the cost model combines them),
    under which workload and devices, and whether it was left for a plan that measured faster."""

    plan: GlobalPlan
    devices: int = Field(ge=1)
    batch: int = Field(ge=1)
    prompt_len: int = Field(ge=1)
    response_mean: float = Field(gt=0)
    measured_s: tuple[float, ...] = Field(description="Recent measured step seconds, oldest first.")
    predicted: tuple[StepTerms, ...] = Field(
        description="The prediction of each of those steps, on the workload it ran, unscaled."
    )
    step: int = Field(ge=0, description="Step of the last measurement.")
    left_for: str | None = Field(
        default=None, description="Plan id it was left for after both were measured (it was slower)."
    )

    @model_validator(mode="after")
    def _paired(self) -> PlanRecord:
        if len(self.measured_s) != len(self.predicted):
            raise ValueError(
                f"{len(self.measured_s)} measured_s but {len(self.predicted)} predicted; "
                "each measurement needs its prediction"
            )
        return self

    @property
    def plan_id(self) -> str:
        return self.plan.plan_id


class ControllerState(Frozen):
    """Everything ``decide`` carries from one step to the next."""

    models: dict[str, ModelConfig]
    stages: tuple[ModelStage, ...] = Field(description="The job's model-stages (``plan.stages_for``).")
    profile: HardwareProfile
    settings: ControllerSettings = ControllerSettings()
    plan: GlobalPlan | None = None
    devices: int | None = None
    steps_since_switch: int = 0
    samples: tuple[Sample, ...] = ()
    transition_samples: tuple[Sample, ...] = ()
    scales: Scales = Scales()
    transition_scales: TransitionScales = TransitionScales()
    records: tuple[PlanRecord, ...] = Field(default=(), description="Plans run and what they measured.")
    highs: tuple[tuple[int, int], ...] = Field(
        default=(), description="(step, high response length) of recent observations, for the forecast."
    )
    probed_at: int | None = Field(default=None, description="Step of the last probes asked for.")
    shapes: tuple[ShapeSample, ...] = Field(
        default=(), description="Recent stage timings by shape (model-stage, tp, pp), newest last."
    )

    @classmethod
    def initial(
        cls,
        models: Mapping[str, ModelConfig],
        profile: HardwareProfile,
        settings: ControllerSettings | None = None,
        *,
        stages: tuple[ModelStage, ...],
        plan: GlobalPlan | None = None,
        devices: int | None = None,
    ) -> ControllerState:
        """The controller before a job's first step; ``models``: model -> its config (a job's
        ``NereusConfig.models``, or ``plan.models_for`` of one model config)."""
        settings = settings or ControllerSettings()
        return cls(
            models=dict(models),
            stages=stages,
            profile=profile,
            settings=settings,
            plan=plan,
            devices=devices,
            steps_since_switch=settings.dwell,  # a plan the job starts on is not a switch: no dwell
        )


Reason = Literal["memory", "slower", "not_worth_it", "dwell", "current"]


class Alternative(Frozen):
    plan_id: str
    description: str
    step_s: float
    memory_peak: int
    reason: Reason
    detail: str


class Decision(Frozen):
    """Keep or switch, with the numbers behind it."""

    action: Literal["keep", "switch", "none"] = Field(description="none: no plan fits in memory.")
    forced: bool
    reason: str
    plan: GlobalPlan | None = Field(description="The plan to run next (None when nothing fits).")
    current: PlanEstimate | None
    chosen: PlanEstimate | None = Field(description="The best candidate weighed (the new plan on a switch).")
    gain_per_step_s: float = Field(
        description="Expected step time of the current plan minus the chosen one's: each plan's "
        "calibrated prediction times its measured/predicted ratio here, else the current plan's."
    )
    current_measured_s: float | None = Field(
        default=None, description="The current plan's measured step time on this workload, if any."
    )
    horizon_steps: int
    transition: TransitionEstimate | None
    moves: InstanceOf[MoveSchedule] | None = Field(
        default=None,
        exclude=True,
        repr=False,
        description="The move schedule ``transition`` priced (the job's pricing, same devices): the "
        "switch carries it and the transition runs it.",
    )
    alternatives: tuple[Alternative, ...]
    probes: tuple[ProbeRequest, ...] = Field(
        default=(), description="Probes to time before the next decision (``controller.probe``)."
    )
    state: ControllerState
    elapsed_s: float
