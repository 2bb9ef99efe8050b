"""What every part of a step works on, passed once: the pool, the job's state, the records, the step,
actor/generate's vLLM engines and the job's prompts.

Boundary: a holder, no behaviour beyond naming what it holds; the state in force is replaced (``state``)
when a switch commits, the step number advances with the loop (flows/job/rl_job.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from flows.job.data import JobData
from flows.job.engine_switch import JobEngines
from flows.job.records import JobRecords
from nereus_core import job
from tasks import rollout_engines
from tasks.runtime.device_pool import DevicePool


@dataclass
class StepContext:
    """The job as one step sees it. ``engines``: actor/generate's vLLM engines across switches (None:
    Nereus's own sampler generates); ``step``: the 0-based step being run (or just run, for a
    decision after it)."""

    pool: DevicePool
    state: job.JobState
    records: JobRecords
    data: JobData
    engines: JobEngines | None = None
    step: int = 0

    @property
    def rollout_engines(self) -> rollout_engines.Engines | None:
        """The vLLM engines in force (None: Nereus's sampler)."""
        return self.engines.current if self.engines is not None else None
