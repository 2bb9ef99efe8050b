"""The world's answer to the controller's probes (``controller.probe``): what a timed probe measures.

Boundary: the simulator's truth for a probe, as ``stage_world`` prices the same work inside a
generation stage, so a probe tells the controller nothing the world's generation would not: a
decode step under TP costs two latency-bound all-reduces per layer (``stage_world.generation_s``,
``ALL_REDUCE_LATENCY_S``), whatever the degree. Measured = true x seeded noise per (seed, step,
degree), like every measured time.
"""

from __future__ import annotations

import numpy as np

from nereus_core.controller.state import ProbeRequest, ProbeTiming
from nereus_core.plan import model_of
from nereus_core.sim import stage_world
from nereus_core.sim.world import World

PROBE_SIGMA = 0.05  # log-sd of a probe's noise: examples/paper_sim.yaml's stage_sigma


def true_probe_s(world: World, request: ProbeRequest) -> float:
    """``request.iterations`` decode steps' TP collectives in the world's generation model."""
    layers = world.sizes[model_of(request.stage)].layers
    return request.iterations * 2 * layers * stage_world.ALL_REDUCE_LATENCY_S


def answer(world: World, k: int, requests: tuple[ProbeRequest, ...]) -> tuple[ProbeTiming, ...]:
    """The probes of ``requests`` as the job would measure them after step ``k``."""
    out = []
    for r in requests:
        noise = np.random.default_rng([world.seed, k, r.tp, 29]).lognormal(0.0, PROBE_SIGMA)
        out.append(ProbeTiming(request=r, seconds=true_probe_s(world, r) * float(noise)))
    return tuple(out)
