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

from dataclasses import dataclass, replace

from nereus_core import job
from nereus_core.config import NereusConfig, ScenarioEvent
from nereus_core.plan import slots_needed
from tasks import model_ops
from tasks.runtime.device_pool import DevicePool


def resume_start(
    cfg: NereusConfig, point: job.ResumePoint | None
) -> tuple[NereusConfig, job.ResumePoint | None, int | None]:
    """The config and resume point a run starts on, and the devices it grows to once they are warm:
    a resume onto more devices than the checkpoint's starts on the checkpoint's (when its plan needs
    no more) and grows to the rest; anything else starts as asked."""
    if point is None or point.devices <= point.checkpoint_devices:
        return cfg, point, None
    if slots_needed(point.layouts) > point.checkpoint_devices:  # a finished switch needs the new devices
        return cfg, point, None
    start = replace(point, devices=point.checkpoint_devices)
    return job.resumed_config(cfg, start), start, point.devices


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
