"""The controller step as a Prefect task: the UI shows every decision as a task run.

Boundary: a thin call into ``nereus_core.job.after_step`` (which asks ``controller.decide``);
the flow carries out what it returns.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from nereus_core.controller.decide import Decision, Observation
from nereus_core.job import JobState, Outcome, after_step


@task(cache_policy=NO_CACHE)
def controller_step(state: JobState, obs: Observation) -> tuple[Outcome, Decision, JobState]:
    """Recalibrate on the step's timings and decide: keep, switch to a better plan, or fail."""
    return after_step(state, obs)
