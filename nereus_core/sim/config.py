"""The simulation config: model, hardware, noise, controller, traces, strategies, and how the sweep runs.

Boundary: a mapping in (the YAML the CLI read), a frozen, validated ``SimConfig``
out; a bad value raises ``ConfigError`` with one line naming the field. Trace files
are paths as written in the config; resolving them against the config's folder is
the caller's business.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from nereus_core.config import LLAMA_3_8B, ConfigError, ModelConfig
from nereus_core.controller import features
from nereus_core.controller.decide import ControllerSettings
from nereus_core.frozen import Frozen
from nereus_core.plan import ModelStage, stages_for
from nereus_core.rl.algorithm import AlgorithmConfig
from nereus_core.sim.noise import NoiseSettings as NoiseSettings
from nereus_core.sim.trace import Shrinks

StrategyKind = Literal["nereus", "static", "openrlhf", "verl"]
OpenRLHFPlacement = Literal["separate", "paired", "colocated"]


class DecisionSettings(Frozen):
    """When the adaptive strategy asks the controller, and what a decision costs the job."""

    every: int = Field(
        default=1,
        ge=1,
        le=10_000,
        description="Ask the controller every k steps (and always when devices or capacity change).",
    )
    cost: Literal["fixed", "measured"] = Field(
        default="fixed",
        description="fixed: charge `seconds` per call (deterministic results); measured: charge each "
        "call's wall time in this process.",
    )
    seconds: float = Field(
        default=0.05,
        ge=0,
        le=3600,
        description="Seconds charged per controller call when cost=fixed (the controller's 50 ms target "
        "at 1,024 devices; benchmarks/bench_controller.py measures it).",
    )
    length_window: int = Field(
        default=5, ge=1, le=1000, description="Recent steps whose lengths make the expected next workload."
    )


class StrategySpec(Frozen):
    """One strategy of the sweep."""

    kind: StrategyKind = Field(description="nereus (adaptive), static, openrlhf or verl.")
    controller: ControllerSettings | None = Field(
        default=None, description="nereus and static: controller settings replacing the config's."
    )
    decision: DecisionSettings | None = Field(
        default=None, description="nereus only: decision settings replacing the config's."
    )
    placements: tuple[OpenRLHFPlacement, ...] = Field(
        default=("separate", "paired", "colocated"),
        min_length=1,
        description="openrlhf only: placements it may use (its flags); the fastest is taken, in its favour.",
    )
    config: Literal["launch", "default", "hindsight"] = Field(
        default="launch",
        description="openrlhf and verl: launch (the fastest config in truth on step 0's workload, what a "
        "user knows at launch), default (the layout of their documented example for an 8B model: "
        "baselines.DEFAULTS) or hindsight (a what-if: the fastest over `tune_steps` steps of the whole "
        "trace); sim/peers.py.",
    )
    tune_steps: int = Field(
        default=16,
        ge=1,
        le=10_000,
        description="openrlhf and verl with config hindsight: trace steps sampled to pick their config.",
    )

    checkpoint_every: int = Field(
        default=20,
        ge=1,
        le=1_000_000,
        description="openrlhf and verl: steps between their synchronous checkpoints (20, verl's GRPO "
        "example's trainer.save_freq; both default to none, which would lose the whole run on a "
        "preemption); sim/peers.py.",
    )

    @field_validator("config", mode="before")
    @classmethod
    def _renamed(cls, value: Any) -> Any:
        if value == "oracle":
            raise ValueError(
                "'oracle' is now 'hindsight' (a what-if: the fastest config over the whole trace); the "
                "peers as they run choose at launch on step 0 ('launch', the default)"
            )
        return value


class TraceSpec(Frozen):
    """One trace of the sweep: a CSV and how to read it."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$", description="Short name, e.g. grow-1024.")
    file: str = Field(min_length=1, description="CSV path (relative paths: the config's folder first).")
    devices: int | None = Field(
        default=None, ge=1, le=65536, description="Devices for every step (replaces the CSV's column)."
    )
    steps: int | None = Field(default=None, ge=1, description="Use only the first N steps.")
    strategies: tuple[str, ...] = Field(default=(), description="Strategies to run on it (empty: all).")
    shrinks: Shrinks = Field(
        default="planned",
        description="How devices leave: planned (a lease ends; a job may write before they go) or "
        "unplanned (preemption: every strategy restarts from its newest checkpoint, rerunning the steps "
        "since it).",
    )


class SweepSettings(Frozen):
    """Where the (trace, strategy, seed) runs execute."""

    mode: Literal["auto", "dask", "inprocess"] = Field(
        default="auto",
        description="auto: in this process when the sweep has at most `inprocess_max` runs, else Dask.",
    )
    workers: int = Field(default=2, ge=1, le=256, description="Dask LocalCluster workers (one thread each).")
    scheduler_address: str | None = Field(
        default=None, description="An existing Dask scheduler (tcp://host:port); None starts a LocalCluster."
    )
    inprocess_max: int = Field(default=2, ge=0, le=10_000, description="Largest sweep auto runs in-process.")


def _default_strategies() -> dict[str, StrategySpec]:
    return {k: StrategySpec(kind=k) for k in ("nereus", "static", "openrlhf", "verl")}


class SimConfig(Frozen):
    """Everything one ``nereus simulate`` run needs."""

    name: str = Field(default="nereus-sim", min_length=1, description="Name of the simulation.")
    model: ModelConfig = Field(default=LLAMA_3_8B, description="Shapes of the job's models (8B by default).")
    algorithm: AlgorithmConfig = Field(
        default=AlgorithmConfig(),
        description="ppo (the default) or grpo with its group_size: which model-stages the job has.",
    )
    kl: bool = Field(
        default=True,
        description="A KL term is used (reward penalty or loss), so reference/infer runs; PPO runs it anyway "
        "(AlgorithmConfig.uses_reference).",
    )
    profile: Literal["h100", "cpu"] = Field(default="h100", description="Hardware profile (hardware.py).")
    seeds: tuple[int, ...] = Field(default=(0,), min_length=1, description="Seeds; each draws its own truth.")
    ppo_epochs: int = Field(default=1, ge=1, le=64, description="Passes of the train stages per step.")
    snapshot_every: int = Field(
        default=features.SNAPSHOT_EVERY,
        ge=0,
        le=1_000_000,
        description="nereus and static (Nereus's runtime): a synchronous checkpoint after every K steps "
        "and after the last, as the job's job.snapshot_every (0: after the last only); the peers write "
        "theirs at their own cadence (sim/peers.py).",
    )
    noise: NoiseSettings = NoiseSettings()
    decision: DecisionSettings = DecisionSettings()
    controller: ControllerSettings = ControllerSettings()
    sweep: SweepSettings = SweepSettings()
    strategies: dict[str, StrategySpec] = Field(default_factory=_default_strategies)
    traces: tuple[TraceSpec, ...] = Field(min_length=1, description="Traces to replay.")

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        for name in self.strategies:
            if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", name):
                raise ValueError(f"strategies.{name}: names use a-z, 0-9, '_', '.', '-'")
        seen: set[str] = set()
        for trace in self.traces:
            if trace.name in seen:
                raise ValueError(f"traces: {trace.name!r} appears twice; trace names must be unique")
            seen.add(trace.name)
            for s in trace.strategies:
                if s not in self.strategies:
                    valid = ", ".join(self.strategies)
                    raise ValueError(f"traces.{trace.name}.strategies: no strategy {s!r}; valid: {valid}")
        self._check_runtime_features()
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds={list(self.seeds)} repeats a seed; list each once")
        return self

    def _check_runtime_features(self) -> None:
        """Refuse a controller setting that asks Nereus (``nereus``, ``static``) for a feature its
        runtime lacks (``controller.features``), naming the field and the fix."""
        for name, spec in self.strategies.items():
            if spec.kind not in ("nereus", "static"):
                continue
            where = f"strategies.{name}.controller" if spec.controller else "controller"
            for field, why in features.asked_but_lacking(spec.controller or self.controller):
                raise ValueError(
                    f"{where}.{field}: {why}; remove the field (the simulated Nereus has only what the "
                    "runtime has: nereus_core/controller/features.py)"
                )

    @property
    def stages(self) -> tuple[ModelStage, ...]:
        """The simulated job's model-stages (``plan.stages_for``): every strategy and the world ask this.
        A reward model scores PPO's responses and a rule GRPO's (``AlgorithmConfig.uses_reward_model``)."""
        a = self.algorithm
        return stages_for(
            critic=a.uses_critic, reference=a.uses_reference(kl=self.kl), reward_model=a.uses_reward_model
        )

    def strategies_for(self, trace: TraceSpec) -> tuple[str, ...]:
        return trace.strategies or tuple(self.strategies)


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_sim_config(data: Any) -> SimConfig:
    """Validate a mapping into a ``SimConfig``; ``ConfigError`` with one line otherwise."""
    if not isinstance(data, dict):
        raise ConfigError(f"a simulation config must be a mapping of sections, got {type(data).__name__}")
    try:
        return SimConfig.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = _where(tuple(first["loc"]))
        msg = first["msg"].removeprefix("Value error, ").removesuffix(" after validation, not 0")
        msg = re.sub(r"^(Input|String|List|Tuple|Value|Dictionary) should", "must", msg)
        if first["type"] == "extra_forbidden":
            msg = "unknown field"
        line = f"{where}: {msg}" if where and not msg.startswith(where) else msg
        raise ConfigError(" ".join(line.splitlines())) from None
