"""The admission rules: given the weighed candidates, keep the plan in force or switch, and say why.

Boundary: pure rules over options the controller has already evaluated (each a
plan's calibrated estimate, the cost of moving to it, and its measured/predicted
step-time ratio when it ran on this workload). Nothing here searches, calibrates or
remembers; ``controller.decide`` does that and builds the Decision.

Like with like. Every plan's expected step time is its calibrated
prediction on the next workload times a measured/predicted ratio: its own, when it ran
here (``controller.history.ratio``), else the plan in force's, applied to the prediction with
each stage's shape residual (``history.shape_residuals``: what the calibrated cost model still
misses about a stage at that tp and pp, measured in any plan), the plan in force's ratio first
cleared of what its own shapes explain. Comparing the plan in force's
*measured* time (a median of a few noisy steps, on slightly different workloads) with
the candidates' *predictions* let the noise pick moves between plans predicted within
0.5 % of each other; on a common basis the gain of a plan that never ran is the
prediction's own relative gain, and a measurement only scales it.

Unforced: switch iff, with ``g = T_now - T_new``,

- ``g >= need * T_now``, ``need = max(floor, noise_z * spread)``: ``spread`` is the
  relative standard deviation of the plan in force's measured/predicted ratios, its
  step-to-step noise, at least the noise pooled over every plan the job measured (a few
  steps that happened to measure alike must not lower it); a smaller gain could not be
  told from that noise by the steps that judge the new plan after the move (and send it
  back if it measures slower).
  The floor is ``min_gain`` for a plan that never ran here (it stands for the cost model's
  error between plans of different shapes), ``min_measured_gain`` for one
  that ran here on this workload: a move chosen on a prediction that measures slower than
  the plan it left goes back on the measurement, not only once it is ``min_gain`` worse;
- ``g * H >= (1 + margin) * C``: the saving over H, the remaining steps capped by
  ``horizon``, pays the predicted move with margin;
- at least ``dwell`` steps since the last switch.

A plan that fits the forecast workload but not with the choosing margin (``tight``) may be
taken unforced too, when its gain is at least ``min_tight_gain`` and pays for two moves (it
will be forced out when the lengths grow back). Without it, a plan forced into more
generation waves by a peak of the lengths never came back to one wave when they fell: at 64
simulated GPUs, 27-34 % slower steps in the dips between peaks.

Among the fastest ``top_k`` plans that pass, the one with the largest net gain
``g * H - (1 + margin) * C`` is taken, so a slightly slower plan much cheaper to
reach can win. A plan left for one that measured faster is not a candidate while
the workload and devices stay as they were. Forced (no dwell, no margin): when there
is no plan yet, the devices changed, or the plan in force no longer fits; then the
plan minimising ``T_new * H + C`` is taken. A forced move also weighs the plans that fit
the forecast workload but not with the choosing margin (``tight``), when one is at least
``min_tight_gain`` faster than every plan that fits with it, charged a second move (it will be
forced out sooner): the margin must not buy a plan far slower than one that lasts the
forecast (waves of generation that halve its speed, for one), nor a move every few steps
for a small gain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from nereus_core.controller.moves import MoveSchedule
from nereus_core.controller.state import Alternative, ControllerSettings, Observation, Reason
from nereus_core.cost.plan_estimate import PlanEstimate
from nereus_core.cost.transition_cost import TransitionEstimate
from nereus_core.plan import GlobalPlan

GiB = 1024**3
Action = Literal["keep", "switch", "none"]


def size(n: float) -> str:
    """Bytes as GiB, or MiB below 1 GiB (tiny models on small slots stay readable)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


class Option(NamedTuple):
    """A candidate plan as admission weighs it."""

    est: PlanEstimate
    move: TransitionEstimate
    ratio: float | None  # its measured/predicted step time on this workload if it ran here
    left_for: str | None  # set: it was left for that plan, which measured faster (not a candidate)
    tight: bool = False  # fits the forecast workload, but not with the choosing margin
    moves: MoveSchedule | None = None  # the schedule ``move`` priced (schedule pricing, same devices)
    shaped_s: float | None = None  # its prediction with its shapes' residuals (``history.shaped_step``)

    @property
    def charged_s(self) -> float:
        """What a move to it is charged: its move, and, if tight, one more (it will not last)."""
        return self.move.seconds * (2.0 if self.tight else 1.0)

    @property
    def measured(self) -> bool:
        return self.ratio is not None

    def step_s(self, basis: float) -> float:
        """Expected step time: the prediction times its own ratio, else its shaped prediction times
        ``basis`` (module docstring)."""
        if self.ratio is not None:
            return self.est.step_s * self.ratio
        return (self.est.step_s if self.shaped_s is None else self.shaped_s) * basis


class Basis(NamedTuple):
    """The plan in force's measured/predicted ratio here (1 when it has none), its spread, and its
    shaped prediction over its plain one (``shape``: what its shapes' residuals explain)."""

    ratio: float = 1.0
    spread: float | None = None
    shape: float = 1.0

    @property
    def fresh(self) -> float:
        """The ratio a plan that never ran here is weighed with, on its shaped prediction: the plan
        in force's, less the part its own shapes' residuals explain."""
        return self.ratio / self.shape

    def gain(self, current: PlanEstimate, o: Option) -> float:
        """``T_now - T_new`` per step, both on this basis."""
        return current.step_s * self.ratio - o.step_s(self.fresh)

    def need(self, settings: ControllerSettings, measured: bool = False, tight: bool = False) -> float:
        """The smallest relative gain admitted: the noise, or a floor if larger: ``min_gain``, which
        stands for the cost model's error, for a plan that never ran here; ``min_measured_gain`` for
        one weighed by its own measurement here (only the noise stands between the two then); at
        least ``min_tight_gain`` for a plan that fits the forecast only without the choosing margin."""
        noise = settings.noise_z * self.spread if self.spread is not None else 0.0
        floor = settings.min_measured_gain if measured and self.spread is not None else settings.min_gain
        return max(floor, noise, settings.min_tight_gain if tight else 0.0)


class Verdict(NamedTuple):
    action: Action
    reason: str
    chosen: Option | None
    alternatives: list[Alternative]
    forced: bool


def forced_reason(
    observation: Observation, plan: GlobalPlan | None, devices: int | None, current: PlanEstimate | None
) -> str:
    """Why the plan in force must change now, or '' if it may stay."""
    capacity = observation.memory_per_device
    if plan is None:
        return "no current plan"
    if devices is not None and devices != observation.devices:
        return f"device set changed ({devices} -> {observation.devices} slots)"
    if current is None:
        return f"the current plan uses slot {plan.devices[-1]}, beyond the {observation.devices} available"
    over = {d: b for d, b in observation.memory_peaks.items() if b > capacity}
    if over:
        d = max(over, key=lambda k: over[k])
        return f"slot {d} peaked at {size(over[d])} > capacity {size(capacity)}"
    if not current.fits:
        return f"the current plan needs {size(current.memory_peak)} per slot > usable {size(current.usable)}"
    return ""


def alternative(
    e: PlanEstimate | None, reason: Reason, detail: str, *, plan=None, step=0.0, mem=0
) -> Alternative:
    plan = plan if e is None else e.plan
    return Alternative(
        plan_id=plan.plan_id,
        description=plan.describe(),
        step_s=step if e is None else e.step_s,
        memory_peak=mem if e is None else e.memory_peak,
        reason=reason,
        detail=detail,
    )


def memory_rejections(rejected: list, faster_than: float, usable: int) -> list[Alternative]:
    """The search's memory rejections faster than ``faster_than``, as alternatives."""
    return [
        alternative(
            None,
            "memory",
            f"needs {size(f.memory)} per slot > usable {size(usable)}",
            plan=f.plan,
            step=f.seconds,
            mem=int(f.memory),
        )
        for f in rejected
        if f.seconds < faster_than and np.isfinite(f.seconds)
    ]


def with_variants(
    alternatives: list[Alternative], variants: list, plan: GlobalPlan | None, current: PlanEstimate | None
) -> list[Alternative]:
    """Add the best plan's one-stage variants (search estimates), once each, after the others."""
    seen = {a.plan_id for a in alternatives} | {p.plan_id for p in (plan, current and current.plan) if p}
    out = list(alternatives)
    for f in variants:
        if f.plan.plan_id not in seen:
            seen.add(f.plan.plan_id)
            detail = "one model-stage on its next-fastest layout (search estimate)"
            out.append(alternative(None, "slower", detail, plan=f.plan, step=f.seconds, mem=int(f.memory)))
    out.sort(key=lambda a: (a.reason != "memory", a.step_s))
    return out


def _left(o: Option, basis: float) -> Alternative:
    detail = f"measured {o.step_s(basis):.3g} s here; left for {o.left_for}, faster"
    return alternative(o.est, "slower", detail)


def _basis(o: Option) -> str:
    return "measured" if o.measured else "predicted"


def forced(
    reason: str,
    options: Sequence[Option],
    rejected: list,
    *,
    current: PlanEstimate | None,
    basis: Basis,
    horizon: int,
    usable: int,
    tight_gain: float = 0.0,
) -> Verdict:
    """The plan minimising ``T * H + C`` (plans left for being slower only if nothing else fits;
    a tight plan only if ``tight_gain`` faster than every plan that lasts, module docstring)."""
    if not options:
        alts = memory_rejections(rejected, float("inf"), usable)
        return Verdict("none", f"{reason}; no plan fits in memory", None, alts, True)
    h, r = max(horizon, 1), basis.fresh  # a measured option's own ratio replaces it
    allowed = [o for o in options if o.left_for is None] or list(options)
    lasting = [o for o in allowed if not o.tight]
    if lasting:  # a tight plan only when it is faster than every lasting one by tight_gain
        floor = min(o.step_s(r) for o in lasting) * (1.0 - tight_gain)
        allowed = lasting + [o for o in allowed if o.tight and o.step_s(r) <= floor]
    best = min(allowed, key=lambda o: o.step_s(r) * h + o.charged_s)
    alts = memory_rejections(rejected, best.est.step_s, usable)
    mine = best.step_s(r) * h + best.charged_s
    for o in options:
        if o.est.plan == best.est.plan or (current is not None and o.est.plan == current.plan):
            continue
        if o.left_for is not None and o not in allowed:
            alts.append(_left(o, r))
            continue
        total = o.step_s(r) * h + o.charged_s
        alts.append(alternative(o.est, "slower", f"{total:.3g} s over {h} steps incl. move vs {mine:.3g} s"))
    if current is not None and best.est.plan == current.plan:
        return Verdict("keep", f"{reason}; the current plan is still the best", best, alts, True)
    return Verdict("switch", reason, best, alts, True)


def _refusal(o: Option, g: float, h: int, need: float, now: float, factor: float) -> str:
    c = o.charged_s
    if g < need * now:
        return f"gain {g:.3g} s/step < {need:.1%} of the {now:.3g} s step ({_basis(o)})"
    if g * h < factor * c:
        return f"gain {g:.3g} s/step x {h} steps = {g * h:.3g} s < {factor:g} x move {c:.3g} s"
    return f"pays ({g * h:.3g} s >= {factor:g} x {c:.3g} s) but nets less than the chosen"


def admit(
    options: Sequence[Option],
    rejected: list,
    *,
    current: PlanEstimate,
    basis: Basis,
    horizon: int,
    settings: ControllerSettings,
    steps_since_switch: int,
) -> Verdict:
    """Keep, or switch to the option with the largest net gain if it pays (module docstring)."""
    h, usable, r = horizon, current.usable, basis.fresh
    now = current.step_s * basis.ratio
    factor = 1.0 + settings.margin
    others = [o for o in options if o.est.plan != current.plan]
    alts = [_left(o, r) for o in others if o.left_for is not None]
    others = [o for o in others if o.left_for is None]
    if not others:
        alts += memory_rejections(rejected, current.step_s, usable)
        return Verdict("keep", "the current plan is the fastest that fits", None, alts, False)

    def pays_for(o: Option) -> bool:
        g = basis.gain(current, o)
        need = basis.need(settings, o.measured, o.tight)
        return g > 0 and g >= need * now and g * h >= factor * o.charged_s

    admissible = [o for o in others if pays_for(o)]
    best = max(admissible or others, key=lambda o: basis.gain(current, o) * h - factor * o.charged_s)
    gain, pays = basis.gain(current, best), bool(admissible)
    need = basis.need(settings, best.measured, best.tight)
    alts += memory_rejections(rejected, min(current.step_s, best.est.step_s), usable)
    for o in others:
        g = basis.gain(current, o)
        if g <= 0:
            alts.append(
                alternative(o.est, "slower", f"{-g:+.3g} s per step vs the current plan ({_basis(o)})")
            )
        elif o is not best or not pays:
            need_o = basis.need(settings, o.measured, o.tight)
            alts.append(alternative(o.est, "not_worth_it", _refusal(o, g, h, need_o, now, factor)))
    if pays and steps_since_switch < settings.dwell:
        alts.append(alternative(best.est, "dwell", f"{steps_since_switch} steps since the last switch"))
        msg = f"dwell: {steps_since_switch} < {settings.dwell} steps since the last switch"
        return Verdict("keep", msg, best, alts, False)
    if not pays:
        msg = "no faster plan pays for its move"
        if 0 < gain < need * now:
            msg = f"the best gain ({gain:.3g} s/step) is below {need:.1%} of the step"
        return Verdict("keep", msg, best, alts, False)
    move = f"2 moves {best.charged_s:.3g} s (tight)" if best.tight else f"move {best.charged_s:.3g} s"
    msg = (
        f"gain {gain:.3g} s/step ({_basis(best)}) x {h} steps >= {factor:g} x {move}"
        f"; {gain / now:.1%} of the step >= {need:.1%}"
    )
    return Verdict("switch", msg, best, alts, False)
