"""Why ``nereus plan`` took each train stage's memory choices: the chosen plan again with every other
choice of that stage at the same degrees (``Layout.shard``, ``Layout.recompute``, a pipeline's
``Layout.schedule``), each with its predicted step time and busiest slot, and what ruled it out.

Boundary: formatting over ``controller.decide.evaluate_plan``; which plan is chosen is the
controller's business.
"""

from __future__ import annotations

from typing import Any

from nereus_core.plan import GlobalPlan, ModelStage


def why_lines(chosen: Any, workload: Any, state: Any) -> list[str]:
    """Per train stage of ``chosen`` (a ``PlanEstimate``): each choice's step and busiest slot."""
    from nereus_core.controller.decide import evaluate_plan

    lines = ["  why (each train stage's memory choices at its degrees; the plan's step and busiest slot):"]
    plan = chosen.plan
    for stage, layout in plan.layouts.items():
        if not ModelStage(stage).trains:
            continue
        for i, other in enumerate(layout.memory_choices()):
            layouts = {**plan.layouts, stage: other}
            est = evaluate_plan(GlobalPlan.of(layouts), workload, state, chosen.usable)
            if i == 0:
                verdict = "chosen: the fastest that fits"
            elif not est.fits:
                verdict = f"over the {chosen.usable / 2**30:.2f} GiB usable"
            elif est.step_s >= chosen.step_s:
                verdict = "fits, slower"
            else:  # faster and fitting, yet not chosen: the plan as a whole weighed otherwise
                verdict = "fits, faster here; not weighed better as a whole plan"
            name = f"{stage}:" if i == 0 else ""
            lines.append(
                f"    {name:<16} {other.memory_choice():<52} step {est.step_s:>9.4g} s "
                f"{est.memory_peak / 2**30:>8.3f} GiB/slot  {verdict}"
            )
    return lines
