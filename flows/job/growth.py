"""When the job's device world grows without a pause: workers start and warm while the job
runs on the old plan, and the switch comes once they are ready, so the pause is the state movement.

    a scenario event ahead adds devices     -> its workers are prepared now; the event itself switches
    nereus resume DIR --devices N (N > the checkpoint's devices)
                                            -> the job resumes on the checkpoint's devices and plan
                                               (bitwise), the other workers are prepared, and the job
                                               grows to N before the first step after they are warm
    a scheduler reports more workers (cluster.max_devices)
                                            -> they are prepared; the job grows onto them once warm

The switch is the forced device change a scenario event makes (``nereus_core.job.apply_event`` ->
the controller -> the transition subflow); this module only says when. Shrinking needs no
preparation: the transition forms the smaller world, and the workers left retire after the switch
(``DevicePool.retire_left``).
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus_core import job
from nereus_core.config import ScenarioEvent
from tasks import model_ops
from tasks.runtime.device_pool import DevicePool


@dataclass
class Growing:
    """The grow the job is preparing, if any: ``target`` slots wanted once their workers are warm."""

    target: int | None = None

    def event(self, pool: DevicePool, state: job.JobState, step: int) -> ScenarioEvent | None:
        """Before ``step``: start preparing any grow to come; a device event once one is ready."""
        cfg = state.config
        ahead = [e.devices for e in cfg.job.scenario if e.step > step and e.devices]
        if ahead and ahead[0] > pool.size:  # the next device event grows: its workers start now
            pool.prepare(ahead[0], warm=model_ops.warm_device)
        if cfg.cluster.max_devices is not None:
            reported = min(pool.reported_devices(), cfg.cluster.max_devices)
            if reported > max(state.devices, self.target or 0):
                self.target = reported
        if self.target is None or self.target <= state.devices:
            self.target = None
            return None
        pool.prepare(self.target, warm=model_ops.warm_device)
        if pool.ready_devices < self.target:
            return None
        devices, self.target = self.target, None
        return ScenarioEvent(step=max(step, 1), devices=devices)
