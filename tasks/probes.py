"""Prefect task: run the probes a decision asked for (``Decision.probes``) on the device pool.

Each probe's TP layout (its slots, tensor parallel over all of them) gets its process groups once
(the pool keeps them), then every slot of it times the collectives ``controller.probe`` prices
(``engine.probe``); the probe took as long as its slowest slot. The timings go to the next
decision (``Observation.probes``), which calibrates the cost model's TP rows on them.

Boundary: the pool runs, ``controller.probe`` says what; the flow records (flows/job/records.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from nereus_core.config import NereusConfig
from nereus_core.controller.state import ProbeRequest, ProbeTiming
from nereus_core.engine.probe import time_tp_collectives
from nereus_core.layout import Layout
from nereus_core.model.weights import param_dtype
from nereus_core.plan import GENERATE, model_of
from tasks.runtime.device_pool import DevicePool

# Latency-bound all-reduces besides the layers' (cost.terms): a decode step's vocab-parallel
# embedding and the sampler's two gathers; a pass's embedding and log-probs.
GENERATE_SMALL, PASS_SMALL = 3, 4


@task(cache_policy=NO_CACHE)
def run_probes(
    pool: DevicePool, cfg: NereusConfig, requests: Sequence[ProbeRequest]
) -> tuple[ProbeTiming, ...]:
    """Every probe of ``requests`` timed on its slots (those beyond the pool are skipped)."""
    out = []
    for r in requests:
        if max(r.devices) >= pool.size:
            continue
        model = cfg.models[model_of(r.stage)]
        layout = Layout(tp=r.tp, devices=r.devices)
        pool.build_groups(layout)
        generate = r.stage == GENERATE
        seconds = pool.run(
            layout,
            time_tp_collectives,
            layout=layout,
            iterations=r.iterations,
            reduces=2 * model.num_hidden_layers,
            rows=r.batch * r.seq,
            hidden=model.hidden_size,
            small=GENERATE_SMALL if generate else PASS_SMALL,
            dtype=param_dtype(model),
        )
        out.append(ProbeTiming(request=r, seconds=max(max(seconds), 1e-9)))
    return tuple(out)
