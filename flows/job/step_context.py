"""What every part of a step works on, passed once: the pool, the job's state, the records, the step,
actor/generate's vLLM engines and the job's prompts; for the loop, the settings it runs by, the grow
it is preparing, the resume point and what start-up found.

Boundary: a holder, no behaviour beyond naming what it holds; the state in force is replaced (``state``)
when a switch commits, the step number advances with the loop (flows/job/rl_job.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flows.job.data import JobData
from flows.job.engine_switch import JobEngines
from flows.job.growth import Growing
from flows.job.records import JobRecords
from nereus_core import job
from nereus_core.config import NereusConfig
from tasks import rollout_engines
from tasks.runtime.device_pool import DevicePool


@dataclass
class StepContext:
    """The job as one step sees it. ``engines``: actor/generate's vLLM engines across switches (None:
    Nereus's own sampler generates); ``step``: the 0-based step being run (or just run, for a
    decision after it).

    For the loop (flows/job/rl_job.py): ``brought_up``, the config as the job was brought up, which
    the loop runs by (``settings``) (steps, validation, adapt, checkpoints; what a switch changes is in
    ``state.config``); ``growing``, the grow being prepared; ``point``, the resume point (None: a
    fresh run); ``started``, what start-up found (the reward fit, a resume's verification, the
    validation before training)."""

    pool: DevicePool
    state: job.JobState
    records: JobRecords
    data: JobData
    engines: JobEngines | None = None
    step: int = 0
    brought_up: NereusConfig | None = None
    growing: Growing = field(default_factory=Growing)
    point: job.ResumePoint | None = None
    started: dict[str, Any] = field(default_factory=dict)

    @property
    def rollout_engines(self) -> rollout_engines.Engines | None:
        """The vLLM engines in force (None: Nereus's sampler)."""
        return self.engines.current if self.engines is not None else None

    @property
    def settings(self) -> NereusConfig:
        """The settings the loop runs by: the config as brought up (else the state's)."""
        return self.brought_up if self.brought_up is not None else self.state.config
