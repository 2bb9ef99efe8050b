"""Probes: cheap timings of what the plan in force cannot show the calibration.

Boundary: pure functions. ``requests`` says which probes the controller wants after a decision;
``sample`` turns a timed probe into a calibration sample (the cost model's unscaled terms of
exactly what the probe ran, and the seconds it took). Running a probe is the job's business
(on the simulator, the world answers it: ``nereus_core.sim.probes``).

Why: the stage timings of a step come from the plan in force, so each stage's TP collectives
are seen at one degree only. A scale fitted there says nothing about how their cost grows with
the degree, and a plan with another TP is priced on the prior until the job happens to run it
(hundreds of steps when the prior is wrong against it). A probe times the collectives at every
degree a stage may use, on the stage's own slots: a few decode steps of one generation replica
(16 steps x 67 small all-reduces: milliseconds on GPUs), and one micro-batch forward of
actor/train's (the passes share their TP rows). Each probe loads only its collective rows: the
fixed cost per call (``tp_calls_generate``, ``tp_calls``: the same at every degree) and the
ring's hops and bytes (``tp_comm_generate``, ``tp_comm``: growing with the degree), so with the
degrees side by side the fit learns how the cost grows with the degree, and the whole-stage
timings fit the rest.
"""

from __future__ import annotations

import math

import numpy as np

from nereus_core.config import Workload
from nereus_core.controller.state import ControllerState, ProbeRequest, ProbeTiming
from nereus_core.cost.calibration import Sample
from nereus_core.cost.stage_cost import TERMS
from nereus_core.cost.terms import generation_collectives_s, model_stats, pass_collectives_s, value_bytes
from nereus_core.plan import GENERATE, GlobalPlan, model_of

GENERATE_ROWS = ("tp_calls_generate", "tp_comm_generate")  # generation_collectives_s's order
PASS_ROWS = ("tp_calls", "tp_comm")
ROWS = GENERATE_ROWS + PASS_ROWS
PASS_STAGE = "actor/train"  # the pass probed: its layout's slots and micro-batch rows


def due(state: ControllerState, step: int) -> bool:
    """Whether probes are due at ``step``: every ``probe_every`` steps (never with 0)."""
    every = state.settings.probe_every
    return every > 0 and (state.probed_at is None or step - state.probed_at >= every)


def requests(plan: GlobalPlan | None, workload: Workload, state: ControllerState) -> tuple[ProbeRequest, ...]:
    """Probes at every TP degree > 1 a stage may use on ``plan``'s slots (powers of two within a node
    that shard the model, ``ModelConfig.tp_error``; the current one included): generation's decode
    steps over one replica's batch at that degree, and one micro-batch forward of ``PASS_STAGE`` (the
    passes share their TP rows) at its micro-batch's rows and the mean sequence."""
    if plan is None:
        return ()
    out = []
    for stage, layout in plan.layouts.items():
        if stage not in (GENERATE, PASS_STAGE):
            continue
        model = state.models[model_of(stage)]
        slots = len(layout.devices)
        rows = math.ceil(math.ceil(workload.batch / layout.dp) / layout.micro_batches)
        tp = 2
        while tp <= min(state.profile.devices_per_node, slots):
            if model.tp_error(tp) is None:
                devices = layout.devices[:tp]
                if stage == GENERATE:
                    batch, iterations = (
                        math.ceil(workload.batch / (slots // tp)),
                        state.settings.probe_iterations,
                    )
                    out.append(
                        ProbeRequest(stage=stage, tp=tp, devices=devices, batch=batch, iterations=iterations)
                    )
                else:
                    seq = workload.prompt_len + round(workload.response_mean)
                    out.append(
                        ProbeRequest(stage=stage, tp=tp, devices=devices, batch=rows, iterations=1, seq=seq)
                    )
            tp *= 2
    return tuple(out)


def sample(timing: ProbeTiming, state: ControllerState) -> Sample:
    """The calibration sample of a timed probe: the cost model's rows for its collectives, priced by
    the formula the stage is (``terms.generation_collectives_s``, ``terms.pass_collectives_s``) with
    the profile's fixed term scales as ``stage_tables`` applies them; the other rows zero."""
    r, profile = timing.request, state.profile
    stats = model_stats(state.models[model_of(r.stage)])
    act = value_bytes(stats, profile).activation
    bw, alpha = profile.link_bandwidth(r.devices), profile.collective_latency_s
    if r.stage == GENERATE:
        rows = GENERATE_ROWS
        parts = generation_collectives_s(
            stats, r.tp, r.iterations, r.batch * r.iterations * r.seq, act, alpha, bw
        )
    else:
        rows = PASS_ROWS
        one = pass_collectives_s(r.tp, stats.layers, r.batch, r.seq, stats.hidden, False, act, alpha, bw)
        parts = tuple(r.iterations * x for x in one)
    terms = np.zeros(len(TERMS))
    for row, seconds in zip(rows, parts, strict=True):
        terms[TERMS.index(row)] = float(seconds) * profile.term_scales.get(row, 1.0)
    return Sample(tuple(terms.tolist()), timing.seconds)
