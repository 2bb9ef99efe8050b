"""The controller step as a Prefect task: the UI shows every decision as a task run.

Boundary: builds what the controller sees after a step (``nereus_core.job.observation``) and asks
``nereus_core.job.after_step`` (which asks ``controller.decide``); the flow carries out what it returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from nereus_core.controller.decide import Decision
from nereus_core.job import JobState, Outcome, after_step, observation


@task(cache_policy=NO_CACHE)
def controller_step(
    state: JobState,
    *,
    step: int,
    ready_devices: int | None = None,
    rows: Sequence[Mapping[str, Any]] = (),
    lengths: Sequence[int] = (),
    prompt_lengths: Sequence[int] = (),
    memory_peaks: Mapping[int, int] | None = None,
) -> tuple[Outcome, Decision, JobState]:
    """Recalibrate on step ``step``'s timings (``rows``), response ``lengths``, real ``prompt_lengths``
    and memory peaks, with ``ready_devices`` slots warm, and decide: keep, switch to a better plan, or
    fail."""
    obs = observation(
        state,
        step=step,
        rows=rows,
        lengths=lengths,
        prompt_lengths=prompt_lengths,
        memory_peaks=memory_peaks,
        ready_devices=ready_devices,
    )
    return after_step(state, obs)
