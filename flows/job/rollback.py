"""A live switch that fails in a live worker rolls back in memory, on the same workers.

    one wave of live moves (``keeps_old``): every device keeps its old shards aside
      -> committed: the old shards are freed (``tasks.transition_ops.release_kept``)
      -> a device call raised on live workers (``can_roll_back``): a new world of the same workers,
         every model-stage of plan A rebuilt on it from the shards its devices kept or still hold,
         bitwise (``engine.rollback``), the inference copies relinked; journal: abort (rolled back)
      -> a worker lost or hung, or a schedule of several waves: no rollback here; the job fails and
         ``nereus resume`` comes back from the switch's recovery point, as before
A schedule of several waves frees a wave's old shards before the next allocates (that order is
what makes it fit, ``nereus_core.gtg.execution``); keeping them would break that promise, so only
one-wave schedules, whose replay already counts every old shard beside every new one, keep them.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger

from nereus_core.config import NereusConfig
from nereus_core.gtg.execution import StageSchedule
from nereus_core.job import model_config, optimizer_settings
from nereus_core.plan import GlobalPlan, copies, own_state
from storage.journal import ABORT, Journal
from tasks.runtime.device_actor import DeviceHungError, DeviceRunError
from tasks.runtime.device_pool import DevicePool
from tasks.transition_ops import relink_copy, restore_stage


def keeps_old(schedule: StageSchedule, path: str) -> bool:
    """Whether the switch's moves keep their old shards until it ends: one wave of live moves only
    (``StageSchedule.kept_sources``)."""
    return path == "live" and bool(schedule.kept_sources)


def can_roll_back(err: BaseException) -> bool:
    """Whether ``err`` came from device calls whose every failing rank answered with its own
    exception (a live worker): a lost worker's or a hung one's state cannot be trusted."""
    if not isinstance(err, DeviceRunError) or isinstance(err, DeviceHungError):
        return False
    return all(f.traceback_text for f in err.failures)


def undo(
    pool: DevicePool, cfg: NereusConfig, journal: Journal, old: GlobalPlan, err: BaseException
) -> dict[str, Any] | None:
    """After ``err`` failed a switch whose devices kept their old shards: roll back in memory when
    ``can_roll_back`` says the workers are all alive (journal: abort, rolled back) and return the
    figures; None to let ``err`` fail the switch as before."""
    if not can_roll_back(err):
        return None
    get_run_logger().error("a live switch failed in live workers; rolling back in memory: %s", err)
    seconds = roll_back(pool, cfg, old)
    journal.record("transition", ABORT, error=f"{type(err).__name__}: {err}"[:500], rolled_back=True)
    error = str(err).splitlines()[0][:300]
    return {"status": "rolled_back", "rollback_s": seconds, "bytes_moved": 0, "operations": 0, "error": error}


def roll_back(pool: DevicePool, cfg: NereusConfig, old: GlobalPlan) -> float:
    """Plan A's model-stages made resident again in a new world of the same workers, its inference
    copies relinked; returns the seconds. Raises if a worker went missing meanwhile."""
    start, workers = time.perf_counter(), pool.workers
    pool.resize(pool.size)  # a failed exchange may have closed gloo pairs: no old group is trusted
    if pool.workers != workers:
        raise RuntimeError("a worker was lost while rolling back: the kept shards are incomplete")
    plan = old.layouts
    for stage in own_state(plan):
        restore_stage(pool, stage, model_config(cfg, stage), plan[stage], optimizer_settings(cfg, stage))
    for copy, source in copies(plan).items():
        relink_copy(pool, copy, source, plan[source], plan[copy], model_config(cfg, copy))
    seconds = time.perf_counter() - start
    get_run_logger().warning("live switch rolled back in memory in %.2f s: plan A %s", seconds, old.plan_id)
    return seconds
