"""The job's checkpoints: every model's state after a step, written once, retried once, pruned; or
staged in host memory and written in the background (a switch's ``async`` recovery point), a
checkpoint once ``finish_in_flight`` has waited for it (after the next step, or before any other
checkpoint).

Boundary: when to checkpoint is the flow's (flows/job/rl_job.py) and the switch's
(flows/job/switch.py); what a checkpoint holds is tasks/job_ops.py's; which ones are kept is
storage/retention.py's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from prefect import get_run_logger

from flows.job.records import CHECKPOINT_ATTEMPTS, JobRecords
from nereus_core import job
from nereus_core.plan import state_stages
from storage import retention
from tasks import job_ops
from tasks.runtime.device_pool import DevicePool


def checkpoint(
    pool: DevicePool,
    state: job.JobState,
    records: JobRecords,
    step: int,
    known_digests: Mapping[str, str] | None = None,
) -> float:
    """Every model's state as ``step``, unless that checkpoint is already written; returns seconds.
    What a failed attempt at ``step`` committed is removed first; once the checkpoint is complete,
    those past ``job.keep_checkpoints`` are deleted (storage/retention.py). ``known_digests``: every
    model's live digest, read just before (else read here when the job verifies)."""
    if not _to_write(pool, state, records, step):
        return 0.0
    run = records.run
    seconds = job_ops.checkpoint(
        pool,
        str(run.root),
        state,
        step,
        digests=state.config.job.verify_transitions,
        known_digests=known_digests,
    )
    records.checkpoint_s += seconds
    _prune(records, state, step)
    return seconds


def stage(
    pool: DevicePool,
    state: job.JobState,
    records: JobRecords,
    step: int,
    known_digests: Mapping[str, str] | None = None,
    in_place: frozenset[str] = frozenset(),
) -> float:
    """Every model's state as ``step`` staged in host memory and written in the background (a switch's
    ``async`` recovery point); it becomes a checkpoint at ``finish_in_flight``. Returns the seconds
    the job was held up (the staging). ``in_place``: model-stages whose shards are never written
    again until the write ends, written without a copy (``transition_schedule.staged_in_place``)."""
    if not _to_write(pool, state, records, step):
        return 0.0
    start = time.perf_counter()
    staged = job_ops.stage_checkpoint(
        pool, str(records.run.root), state, step, known_digests=known_digests, in_place=in_place
    )
    records.in_flight = InFlight(staged, state)
    seconds = time.perf_counter() - start
    records.checkpoint_s += seconds
    return seconds


@dataclass(frozen=True)
class InFlight:
    """A checkpoint being written in the background, and the job state it holds."""

    staged: job_ops.StagedCheckpoint
    state: job.JobState


def finish_in_flight(pool: DevicePool, records: JobRecords) -> bool | None:
    """The checkpoint written in the background, if any, waited for and made a resume point; a write
    that failed is logged and dropped (the previous checkpoint stays the resume point). Returns
    None when none was in flight, else whether it became a checkpoint."""
    writing, records.in_flight = records.in_flight, None
    if writing is None:
        return None
    try:
        records.checkpoint_s += job_ops.finish_checkpoint(pool, str(records.run.root), writing.staged)
    except Exception as err:
        get_run_logger().error(
            "the checkpoint of step %d written in the background failed; the previous one stays the "
            "resume point: %s",
            writing.staged.step,
            err,
        )
        return False
    _prune(records, writing.state, writing.staged.step)
    return True


def _to_write(pool: DevicePool, state: job.JobState, records: JobRecords, step: int) -> bool:
    """Before a checkpoint of ``step``: the one in flight finished first; False when ``step``'s is
    already complete, else what a failed attempt at it left is removed and True."""
    finish_in_flight(pool, records)
    if retention.has_checkpoint(records.run.root, step):
        return False
    retention.discard_partial(records.run.root, step, state_stages(state.layouts))
    return True


def _prune(records: JobRecords, state: job.JobState, step: int) -> None:
    try:
        retention.prune_checkpoints(records.run.root, state.config.job.keep_checkpoints)
    except OSError as err:  # the new checkpoint is complete: the run goes on, holding one more
        get_run_logger().warning("old checkpoints could not be deleted after step %d's: %s", step, err)


def try_checkpoint(
    pool: DevicePool, state: job.JobState, records: JobRecords, step: int, attempts: int = CHECKPOINT_ATTEMPTS
) -> list[str]:
    """A checkpoint at ``step``, tried up to ``attempts`` times; returns the failed attempts' errors
    (``attempts`` of them: none was written, the previous checkpoint stays the resume point)."""
    errors: list[str] = []
    for attempt in range(1, attempts + 1):
        try:
            checkpoint(pool, state, records, step)
            return errors
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")
            get_run_logger().error("checkpoint at step %d failed (attempt %d): %s", step, attempt, err)
    return errors
