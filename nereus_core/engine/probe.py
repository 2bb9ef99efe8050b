"""A probe of tensor-parallel collectives on one device: what ``controller.probe`` asks the job to time.

The controller sees each stage's TP collectives only at the degree the plan in force runs, so it
asks for probes at the other degrees (``controller.probe.requests``): a few decode steps of one
generation replica, or one micro-batch forward of a pass. A probe runs exactly the collectives
the cost model prices for them (``cost.terms.generation_collectives_s``, ``pass_collectives_s``):
per decode step or pass, two all-reduces per decoder layer of the hidden states of the rows passed,
plus the latency-bound ones of the embedding, the log-probs or the sampler. Nothing else runs: the
collectives are on zeros in the model's activation dtype, no model state is read or written.

Boundary: device-side functions over one ``DeviceContext`` whose world built the probe's layout.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from nereus_core.engine.device import DeviceContext
from nereus_core.layout import Layout


def time_tp_collectives(
    ctx: DeviceContext,
    *,
    layout: Layout,
    iterations: int,
    reduces: int,
    rows: int,
    hidden: int,
    small: int,
    dtype: torch.dtype,
) -> float:
    """Seconds this device spent in ``iterations`` x (``reduces`` all-reduces of ``rows`` x ``hidden``
    values and ``small`` of one value) over ``layout``'s TP group, after a barrier of that group."""
    group = ctx.view(layout).tp_group
    states = torch.zeros((rows, hidden), dtype=dtype, device=ctx.device)
    scalar = torch.zeros(1, dtype=dtype, device=ctx.device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iterations):
        for _ in range(reduces):
            dist.all_reduce(states, group=group)
        for _ in range(small):
            dist.all_reduce(scalar, group=group)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return time.perf_counter() - start
