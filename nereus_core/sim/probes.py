"""The world's answer to the controller's probes (``controller.probe``): what a timed probe measures
and what running it costs the job (``charged_s``).

Boundary: the simulator's truth for a probe, as ``stage_world`` prices the same collectives
inside a stage, so a probe tells the controller nothing the world's stages would not: a decode
step under TP costs two latency-bound all-reduces per layer (``stage_world.generation_s``), a
pass's micro-batch two per layer of its hidden states over the link (``stage_world.pass_parts``).
Measured = true x seeded noise per (seed, step, stage, degree), like every measured time.
"""

from __future__ import annotations

import numpy as np

from nereus_core.controller.state import ProbeRequest, ProbeTiming
from nereus_core.plan import GENERATE, model_of
from nereus_core.sim import stage_world
from nereus_core.sim.world import World

PROBE_SIGMA = 0.05  # log-sd of a probe's noise: examples/paper_sim.yaml's stage_sigma


def true_probe_s(world: World, request: ProbeRequest) -> float:
    """The probe's collectives in the world's model: generation's decode steps (2 latency-bound
    all-reduces per layer each, ``stage_world.generation_s``), or a pass's micro-batch forwards (2
    all-reduces per layer of the micro-batch's hidden states over the link, plus their latency,
    ``stage_world.pass_parts``)."""
    size = world.sizes[model_of(request.stage)]
    latency = request.iterations * 2 * size.layers * stage_world.ALL_REDUCE_LATENCY_S
    if request.stage == GENERATE:
        return latency
    p = world.profile
    gpu = stage_world.Gpu(p.name, p.peak_flops, p.memory_bandwidth, float(p.memory_per_device))
    shape = stage_world.Shape(tp=request.tp, devices_per_node=p.devices_per_node)
    ring = 2.0 * (request.tp - 1) / request.tp
    tokens = request.iterations * request.batch * request.seq
    volume = tokens * size.layers * 2 * size.hidden * 2.0 * ring
    return volume / stage_world.tp_link(shape, gpu) + latency


def answer(world: World, k: int, requests: tuple[ProbeRequest, ...]) -> tuple[ProbeTiming, ...]:
    """The probes of ``requests`` as the job would measure them after step ``k``."""
    out = []
    for r in requests:
        noise = np.random.default_rng([world.seed, k, r.tp, int(r.stage == GENERATE), 29]).lognormal(
            0.0, PROBE_SIGMA
        )
        out.append(ProbeTiming(request=r, seconds=true_probe_s(world, r) * float(noise)))
    return tuple(out)


def charged_s(world: World, timings: tuple[ProbeTiming, ...], built: set[tuple]) -> float:
    """What running ``timings``' probes cost the job, as the runtime runs them (``tasks.probes``):
    each probe's seconds and one device call, and the first time a probe's slots are probed in a
    world, their process groups (``group_setup_s``: NCCL communicators on a GPU). ``built`` holds
    the slots whose groups this world built so far; it is updated."""
    costs = world.profile.transitions
    seconds = 0.0
    for t in timings:
        key = (t.request.tp, t.request.devices)
        if key not in built:
            built.add(key)
            seconds += costs.group_setup_s + costs.groups_s
        seconds += t.seconds + costs.call_s
    return seconds
