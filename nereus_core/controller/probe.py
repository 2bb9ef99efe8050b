"""Probes: cheap timings of what the plan in force cannot show the calibration.

Boundary: pure functions. ``requests`` says which probes the controller wants after a decision;
``sample`` turns a timed probe into a calibration sample (the cost model's unscaled terms of
exactly what the probe ran, and the seconds it took). Running a probe is the job's business
(on the simulator, the world answers it: ``nereus_core.sim.probes``).

Why: the stage timings of a step come from the plan in force, so generation's TP collectives
are seen at one degree only. One scale fitted there (``tp_comm_generate``) says nothing about
how the cost of those collectives grows with the degree, and a plan with another generation TP
is priced on the prior until the job happens to run it (hundreds of steps when the prior is
wrong against it). A probe times the collectives of a few decode steps of one generation
replica at every degree generation may use, on the generation slots themselves (a few ms on
GPUs: 16 decode steps x 67 small all-reduces). Each probe loads generation's two collective rows
only (``tp_calls_generate``: a fixed cost per call; ``tp_comm_generate``: ring hops and bytes,
growing with the degree), so with the degrees side by side the fit learns how the cost grows
with the degree, and the whole-stage timings fit the rest.
"""

from __future__ import annotations

import math

import numpy as np

from nereus_core.controller.state import ControllerState, ProbeRequest, ProbeTiming
from nereus_core.cost.calibration import Sample
from nereus_core.cost.stage_cost import TERMS, Workload
from nereus_core.cost.terms import generation_collectives_s, model_stats, value_bytes
from nereus_core.plan import GENERATE, GlobalPlan, model_of

ROWS = ("tp_calls_generate", "tp_comm_generate")


def due(state: ControllerState, step: int) -> bool:
    """Whether probes are due at ``step``: every ``probe_every`` steps (never with 0)."""
    every = state.settings.probe_every
    return every > 0 and (state.probed_at is None or step - state.probed_at >= every)


def requests(plan: GlobalPlan | None, workload: Workload, state: ControllerState) -> tuple[ProbeRequest, ...]:
    """A probe for every TP degree > 1 that generation may use on ``plan``'s generation slots: powers
    of two within a node that shard the actor (``ModelConfig.tp_error``), the current one included,
    each over one replica's batch at that degree."""
    if plan is None or GENERATE not in plan.layouts:
        return ()
    layout = plan.layouts[GENERATE]
    model = state.models[model_of(GENERATE)]
    slots = len(layout.devices)
    limit = min(state.profile.devices_per_node, slots)
    out = []
    tp = 2
    while tp <= limit:
        if model.tp_error(tp) is None:
            dp = slots // tp
            out.append(
                ProbeRequest(
                    stage=GENERATE,
                    tp=tp,
                    devices=layout.devices[:tp],
                    batch=math.ceil(workload.batch / dp),
                    iterations=state.settings.probe_iterations,
                )
            )
        tp *= 2
    return tuple(out)


def sample(timing: ProbeTiming, state: ControllerState) -> Sample:
    """The calibration sample of a timed probe: the cost model's ``tp_calls_generate`` and
    ``tp_comm_generate`` rows for its collectives (``terms.generation_collectives_s``, the formula
    generation is priced by, with the profile's fixed term scales as ``stage_tables`` applies them),
    the other rows zero."""
    r, profile = timing.request, state.profile
    stats = model_stats(state.models[model_of(r.stage)])
    act = value_bytes(stats, profile).activation
    bw = profile.link_bandwidth(r.devices)
    parts = generation_collectives_s(
        stats, r.tp, r.iterations, r.batch * r.iterations, act, profile.collective_latency_s, bw
    )
    terms = np.zeros(len(TERMS))
    for row, seconds in zip(ROWS, parts, strict=True):
        terms[TERMS.index(row)] = float(seconds) * profile.term_scales.get(row, 1.0)
    return Sample(tuple(terms.tolist()), timing.seconds)
