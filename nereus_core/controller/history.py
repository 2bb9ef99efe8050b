"""What the controller remembers between steps: each plan's measured step time, and the length trend.

Boundary: pure functions over ``PlanRecord`` tuples and (step, length) pairs; the
controller asks them and stores their answers in its state. Two memories:

- **Measured step times, as ratios to their predictions.** After a step, the stage
  times the plan in force measured are combined as the cost model combines its
  predictions (``step_seconds``: the same placement rule and weight sync) and kept
  beside the prediction for that same step's workload, unscaled (``StepTerms``), so
  it is re-priced with the scales of the day. Their ratio (the plan's residual) is
  what admission uses: it carries a measurement to the next workload without mixing
  in the length drift between steps or the calibration's drift since, and its spread
  is the plan's step-to-step noise. A record holds while the workload stays within
  ``workload_margin`` of the mean prompt and response lengths it was first measured at, on
  the same devices and batch; a plan left for one that measured faster is not chosen again there
  (no A -> B -> A -> B).
- **A forecast of the high response length**: a least-squares line through the recent
  highs, ``forecast_steps`` ahead, never below the latest; a newly chosen plan must fit
  it, the plan in force only today's (hysteresis against forced moves at every growth).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from nereus_core.config import Workload
from nereus_core.controller.state import PlanRecord, ShapeSample, StageTiming, StepTerms
from nereus_core.cost.plan_estimate import PlanEstimate, step_seconds
from nereus_core.cost.stage_cost import Scales
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan

KEPT_MEASUREMENTS = 5  # per plan: the median of the last few resists one noisy step
KEPT_RECORDS = 64  # plans remembered; the oldest measured is forgotten first
KEPT_SHAPES = 256  # stage timings kept by shape, newest last
SHAPE_MEASUREMENTS = 5  # per shape: the median of its last few


def similar(record: PlanRecord, workload: Workload, devices: int, margin: float) -> bool:
    """Whether ``record`` was measured under this workload (the mean prompt and response lengths each
    within ``margin``; prompts vary by a few tokens from step to step) and devices."""
    return (
        record.devices == devices
        and record.batch == workload.batch
        and abs(workload.prompt_len - record.prompt_len) <= margin * record.prompt_len
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
    """The median measured step seconds (for reports; admission reads ``ratio``)."""
    return statistics.median(record.measured_s) if record is not None else None


class Pricing(NamedTuple):
    """The calibration of the day: what a step's unscaled terms cost now."""

    scales: Scales
    wire: float
    overlap: bool

    def terms(self, e: PlanEstimate) -> StepTerms:
        """``e``'s prediction, unscaled (its stages' raw terms; the sync without the wire scale)."""
        raw = {s: tuple(x.raw.values()) for s, x in e.stages.items()}
        return StepTerms(raw=raw, sync_raw=e.sync_s / self.wire if self.wire > 0 else 0.0)

    def seconds(self, plan: GlobalPlan, t: StepTerms) -> float:
        a = self.scales.as_array()
        stages = {s: float(a @ np.asarray(raw)) for s, raw in t.raw.items()}
        return step_seconds(plan.layouts, stages, t.sync_raw * self.wire, overlap=self.overlap)


def ratios(record: PlanRecord | None, pricing: Pricing) -> list[float]:
    """The plan's measured/predicted step times, each re-priced with today's scales."""
    if record is None:
        return []
    priced = (pricing.seconds(record.plan, t) for t in record.predicted)
    return [m / p for m, p in zip(record.measured_s, priced, strict=True) if p > 0]


def ratio(record: PlanRecord | None, pricing: Pricing) -> float | None:
    """The plan's measured/predicted step time here (median of its recent steps), or None."""
    r = ratios(record, pricing)
    return statistics.median(r) if r else None


def spread(record: PlanRecord | None, pricing: Pricing, records: Sequence[PlanRecord] = ()) -> float | None:
    """The relative standard deviation of the plan's measured/predicted ratios (its step-to-step
    noise once the workload's drift is divided out), at least the job's pooled over ``records``;
    None below two measurements of the plan. Three or five steps of one plan can show a tenth
    of the noise the job has, which let one noisy run of steps send a plan away that was faster."""
    own = ratios(record, pricing)
    if len(own) < 2:
        return None
    return max(_pooled_noise([own]), _pooled_noise([ratios(r, pricing) for r in records]))


def _pooled_noise(samples: Sequence[Sequence[float]]) -> float:
    """The relative standard deviation pooled over samples of two or more (each about its own
    mean, one degree of freedom lost per sample); 0 when none has two."""
    squares, dof = 0.0, 0
    for rs in (r for r in samples if len(r) >= 2):
        mean = statistics.fmean(rs)
        squares += sum((x / mean - 1.0) ** 2 for x in rs)
        dof += len(rs) - 1
    return math.sqrt(squares / dof) if dof else 0.0


def shape_of(stage: str, layout: Layout) -> str:
    """A model-stage's shape for the shape residuals: the stage and its tp and pp degrees."""
    return f"{stage}@tp{layout.tp}.pp{layout.pp}"


def push_shapes(kept: Sequence[ShapeSample], new: Sequence[ShapeSample]) -> tuple[ShapeSample, ...]:
    return (*kept, *new)[-KEPT_SHAPES:]


def shape_residuals(samples: Sequence[ShapeSample], scales: Scales) -> dict[str, float]:
    """Per shape measured (``shape_of``): the median measured/predicted seconds of its last few
    timings, each re-priced with today's scales. The scales are fitted over every stage of every
    shape at once; what they still miss about one shape (generation at another TP degree, say, whose
    decode the cost model speeds up more than the engine does) is this residual, and a candidate
    that shares the shape is weighed with it (``shaped_step``) before it has run."""
    a, by = scales.as_array(), {}
    for sample in reversed(samples):
        seen = by.setdefault(sample.shape, [])
        predicted = float(a @ np.asarray(sample.raw))
        if len(seen) < SHAPE_MEASUREMENTS and predicted > 0:
            seen.append(sample.seconds / predicted)
    return {shape: statistics.median(r) for shape, r in by.items() if r}


def shaped_step(e: PlanEstimate, residuals: Mapping[str, float], *, overlap: bool) -> float:
    """``e``'s step seconds with each stage's prediction times its shape's residual (1 if unmeasured)."""
    layouts = e.plan.layouts
    stages = {s: x.seconds * residuals.get(shape_of(s, layouts[s]), 1.0) for s, x in e.stages.items()}
    return step_seconds(layouts, stages, e.sync_s, overlap=overlap)


def measured_workload(plan: GlobalPlan, timings: Sequence[StageTiming]) -> Workload | None:
    """The workload the plan's timings ran, when they say (else the observation's)."""
    work = None
    for t in timings:
        if plan.layouts.get(t.stage) == t.layout:
            work = t.workload or work
    return work


def step_measurement(
    plan: GlobalPlan, predicted: PlanEstimate, timings: Sequence[StageTiming], *, overlap: bool
) -> float | None:
    """The step time ``plan`` measured (mean of each stage's timings on its layout; an unmeasured
    stage and the weight sync at their prediction ``predicted``, on the measured workload), or None
    if no stage of the plan was measured."""
    seen: dict[str, list[float]] = {}
    for t in timings:
        if plan.layouts.get(t.stage) == t.layout:
            seen.setdefault(t.stage, []).append(t.seconds)
    if not seen:
        return None
    stages: Mapping[str, float] = {
        s: (sum(seen[s]) / len(seen[s]) if s in seen else predicted.stages[s].seconds) for s in plan.layouts
    }
    return step_seconds(plan.layouts, stages, predicted.sync_s, overlap=overlap)


def remember(
    records: Sequence[PlanRecord],
    plan: GlobalPlan,
    *,
    seconds: float,
    predicted: StepTerms,
    workload: Workload,
    devices: int,
    step: int,
    margin: float,
) -> tuple[PlanRecord, ...]:
    """Records with one more measurement of ``plan`` and its prediction for the same step (a new
    record when the workload or devices moved beyond the margin). The plan runs now, so it was not
    left: its ``left_for`` clears."""
    plan_id = plan.plan_id
    old = next((r for r in records if r.plan_id == plan_id), None)
    kept = old.measured_s if old is not None and similar(old, workload, devices, margin) else ()
    if old is not None and kept:  # the reference workload stays the one first measured (no drift)
        new = old.model_copy(
            update={
                "measured_s": (*kept, seconds)[-KEPT_MEASUREMENTS:],
                "predicted": (*old.predicted, predicted)[-KEPT_MEASUREMENTS:],
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
            predicted=(predicted,),
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
