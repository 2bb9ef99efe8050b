"""One simulation run, (trace, strategy, seed) -> records and summary: the unit a sweep fans out.

Boundary: everything a run needs travels in ``SimJob`` (config, parsed trace, names),
so a run is a pure function of it and gives the same result in any process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nereus_core.cost.hardware import get_profile
from nereus_core.sim.baselines import OpenRLHFStrategy, VerlStrategy
from nereus_core.sim.config import SimConfig
from nereus_core.sim.loop import Strategy, simulate
from nereus_core.sim.results import summarize_run
from nereus_core.sim.strategies import NereusStrategy, StaticStrategy
from nereus_core.sim.trace import Trace
from nereus_core.sim.world import World


@dataclass(frozen=True)
class SimJob:
    config: SimConfig
    trace: Trace
    strategy: str
    seed: int

    @property
    def key(self) -> str:
        return f"{self.trace.name}/{self.strategy}/seed{self.seed}"


@dataclass
class SimResult:
    trace: str
    strategy: str
    seed: int
    records: list[dict]
    plans: dict[str, str]
    summary: dict


def make_strategy(config: SimConfig, name: str) -> Strategy:
    """The strategy called ``name`` in ``config``."""
    spec = config.strategies[name]
    profile = get_profile(config.profile)
    settings = spec.controller or config.controller
    if spec.kind == "nereus":
        decision = spec.decision or config.decision
        return NereusStrategy(
            name,
            model=config.model,
            profile=profile,
            settings=settings,
            decision=decision,
            snapshot_every=config.snapshot_every,
        )
    if spec.kind == "static":
        return StaticStrategy(
            name, model=config.model, profile=profile, settings=settings, snapshot_every=config.snapshot_every
        )
    if spec.kind == "verl":
        return VerlStrategy(name, spec=spec, settings=settings)
    return OpenRLHFStrategy(name, spec=spec, settings=settings)


def run_job(job: SimJob) -> SimResult:
    """Simulate one (trace, strategy, seed)."""
    cfg = job.config
    trace = replace(job.trace, ppo_epochs=cfg.ppo_epochs)
    world = World(trace, cfg.model, get_profile(cfg.profile), cfg.noise, job.seed, stages=cfg.stages)
    records, plans = simulate(world, make_strategy(cfg, job.strategy), trace=trace.name, seed=job.seed)
    return SimResult(trace.name, job.strategy, job.seed, records, plans, summarize_run(records))
