"""The job's checkpoints: every model's state after a step, written once, retried once, pruned.

Boundary: when to checkpoint is the flow's (flows/job/rl_job.py) and the switch's
(flows/job/switch.py); what a checkpoint holds is tasks/job_ops.py's; which ones are kept is
storage/retention.py's.
"""

from __future__ import annotations

from prefect import get_run_logger

from flows.job.records import CHECKPOINT_ATTEMPTS, JobRecords
from nereus_core import job
from nereus_core.plan import state_stages
from storage import retention
from tasks import job_ops
from tasks.runtime.device_pool import DevicePool


def checkpoint(pool: DevicePool, state: job.JobState, records: JobRecords, step: int) -> float:
    """Every model's state as ``step``, unless that checkpoint is already written; returns seconds.
    What a failed attempt at ``step`` committed is removed first; once the checkpoint is complete,
    those past ``job.keep_checkpoints`` are deleted (storage/retention.py)."""
    run = records.run
    if retention.has_checkpoint(run.root, step):
        return 0.0
    retention.discard_partial(run.root, step, state_stages(state.layouts))
    seconds = job_ops.checkpoint(
        pool, str(run.root), state, step, digests=state.config.job.verify_transitions
    )
    records.checkpoint_s += seconds
    try:
        retention.prune_checkpoints(run.root, state.config.job.keep_checkpoints)
    except OSError as err:  # the new checkpoint is complete: the run goes on, holding one more
        get_run_logger().warning("old checkpoints could not be deleted after step %d's: %s", step, err)
    return seconds


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
