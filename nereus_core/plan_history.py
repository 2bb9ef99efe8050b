"""What the controller remembers between steps: each plan's measured step time, and the length trend.

Boundary: pure functions over ``PlanRecord`` tuples and (step, length) pairs; the
controller asks them and stores their answers in its state. Two memories (issue 17):

- **Measured step times.** After a step, the stage times the plan in force measured
  are combined as the cost model combines its predictions (``step_seconds``: the same
  placement rule and weight sync), so measurement and prediction are comparable. A
  plan's measured time holds while the workload stays within ``workload_margin`` of
  the mean response length it was measured at, on the same devices; within that the
  controller prefers it to any prediction, and a plan left for one that measured
  faster is not chosen again (no A -> B -> A -> B).
- **A forecast of the high response length**: a least-squares line through the recent
  highs, ``forecast_steps`` ahead, never below the latest; a newly chosen plan must fit
  it, the plan in force only today's (hysteresis against forced moves at every growth).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import numpy as np

from nereus_core.controller_state import PlanRecord, StageTiming
from nereus_core.cost_model import Workload
from nereus_core.plan import GlobalPlan
from nereus_core.plan_estimate import PlanEstimate, step_seconds

KEPT_MEASUREMENTS = 5  # per plan: the median of the last few resists one noisy step
KEPT_RECORDS = 64  # plans remembered; the oldest measured is forgotten first


def similar(record: PlanRecord, workload: Workload, devices: int, margin: float) -> bool:
    """Whether ``record`` was measured under this workload (mean response within ``margin``) and devices."""
    return (
        record.devices == devices
        and record.batch == workload.batch
        and record.prompt_len == workload.prompt_len
        and abs(workload.response_mean - record.response_mean) <= margin * record.response_mean
    )


def find(
    records: Sequence[PlanRecord], plan_id: str, workload: Workload, devices: int, margin: float
) -> PlanRecord | None:
    """The record of ``plan_id`` if it holds for this workload and devices."""
    for r in records:
        if r.plan_id == plan_id:
            return r if similar(r, workload, devices, margin) else None
    return None


def measured(record: PlanRecord | None) -> float | None:
    return statistics.median(record.measured_s) if record is not None else None


def step_measurement(
    plan: GlobalPlan, predicted: PlanEstimate, timings: Sequence[StageTiming], *, overlap: bool
) -> tuple[float, Workload | None] | None:
    """The step time ``plan`` measured (mean of each stage's timings on its layout; an unmeasured
    stage and the weight sync at their prediction) and the workload it ran, or None if no stage of
    the plan was measured."""
    seen: dict[str, list[float]] = {}
    work = None
    for t in timings:
        if plan.layouts.get(t.stage) == t.layout:
            seen.setdefault(t.stage, []).append(t.seconds)
            work = t.workload or work
    if not seen:
        return None
    stages: Mapping[str, float] = {
        s: (sum(seen[s]) / len(seen[s]) if s in seen else predicted.stages[s].seconds) for s in plan.layouts
    }
    return step_seconds(plan.placement, stages, predicted.sync_s, overlap=overlap), work


def remember(
    records: Sequence[PlanRecord],
    plan: GlobalPlan,
    *,
    seconds: float,
    predicted_s: float,
    workload: Workload,
    devices: int,
    step: int,
    margin: float,
) -> tuple[PlanRecord, ...]:
    """Records with one more measurement of ``plan`` (a new record when the workload or devices
    moved beyond the margin). The plan runs now, so it was not left: its ``left_for`` clears."""
    plan_id = plan.plan_id
    old = next((r for r in records if r.plan_id == plan_id), None)
    kept = old.measured_s if old is not None and similar(old, workload, devices, margin) else ()
    if old is not None and kept:  # the reference workload stays the one first measured (no drift)
        new = old.model_copy(
            update={
                "measured_s": (*kept, seconds)[-KEPT_MEASUREMENTS:],
                "predicted_s": predicted_s,
                "step": step,
                "left_for": None,
            }
        )
    else:
        new = PlanRecord(
            plan=plan,
            devices=devices,
            batch=workload.batch,
            prompt_len=workload.prompt_len,
            response_mean=workload.response_mean,
            measured_s=(seconds,),
            predicted_s=predicted_s,
            step=step,
        )
    others = [r for r in records if r.plan_id != plan_id][-(KEPT_RECORDS - 1) :]
    return (*others, new)


def measured_plans(
    records: Sequence[PlanRecord], workload: Workload, devices: int, margin: float
) -> list[GlobalPlan]:
    """The plans measured under this workload and devices (candidates even if the search ranks them low)."""
    return [r.plan for r in records if similar(r, workload, devices, margin)]


def mark_left(records: Sequence[PlanRecord], plan_id: str, for_id: str) -> tuple[PlanRecord, ...]:
    """``plan_id`` was left for ``for_id``, which measured faster: do not choose it again here."""
    return tuple(r.model_copy(update={"left_for": for_id}) if r.plan_id == plan_id else r for r in records)


def push_high(
    highs: Sequence[tuple[int, int]], step: int, high: int, window: int
) -> tuple[tuple[int, int], ...]:
    """The recent (step, high length) pairs with this observation (one per step, newest last)."""
    kept = [h for h in highs if h[0] < step]
    return (*kept, (step, high))[-window:]


def forecast(workload: Workload, highs: Sequence[tuple[int, int]], steps_ahead: int) -> Workload:
    """``workload`` with its high response length raised to the trend's value ``steps_ahead`` on
    (a least-squares line through ``highs``; never lowered: a shrinking trend changes nothing)."""
    if steps_ahead <= 0 or len(highs) < 3:
        return workload
    x = np.array([h[0] for h in highs], dtype=float)
    y = np.array([h[1] for h in highs], dtype=float)
    if np.ptp(x) == 0:
        return workload
    slope, intercept = np.polyfit(x, y, 1)
    ahead = float(intercept + slope * (x[-1] + steps_ahead))
    if slope <= 0 or ahead <= workload.response_high:
        return workload
    return workload.model_copy(update={"response_high": math.ceil(ahead)})
