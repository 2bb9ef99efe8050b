"""nereus_core.controller.probe: which probes a decision asks for, and that a timed probe calibrates
generation's TP collectives at degrees the plan in force does not run."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nereus_core.controller import probe
from nereus_core.controller.decide import ProbeRequest, ProbeTiming, StageTiming, decide
from nereus_core.controller.decide import observe as calibrate
from nereus_core.cost.stage_cost import TERMS, Scales, estimate
from nereus_core.layout import Layout
from nereus_core.plan import GENERATE
from tests.support.controller_setup import GB, fresh, observe, work
from tests.support.model_configs import MID

W = work(batch=256, prompt=128, mean=256, high=512)
DEVICES = 16
# A world whose generation collectives are latency-bound and cost the same at every degree: the ring
# part of the prior (growing with the degree) is 20x too dear, the fixed cost per call 8x too cheap.
HIDDEN = Scales(tp_comm_generate=0.05, tp_calls_generate=8.0)


def test_probes_cover_every_generation_degree_every_probe_every_steps() -> None:
    d = decide(observe(DEVICES, 80 * GB, W), fresh())
    gen = d.plan.layouts[GENERATE]
    degrees = [r.tp for r in d.probes]
    assert degrees == [t for t in (2, 4, 8) if MID.tp_error(t) is None] and 4 in degrees
    for r in d.probes:
        assert r.devices == gen.devices[: r.tp]
        assert r.batch == math.ceil(W.batch / (len(gen.devices) // r.tp))
    assert d.state.probed_at == 1
    later = d.state
    for step, asked in ((2, False), (10, False), (11, True)):
        obs = observe(DEVICES, 80 * GB, W).model_copy(update={"step": step})
        out = decide(obs, later)
        assert bool(out.probes) is asked, step
        later = out.state
    never = decide(observe(DEVICES, 80 * GB, W), fresh(probe_every=0))
    assert never.probes == () and never.state.probed_at is None
    with pytest.raises(ValueError, match="3 devices for a tp=2 probe"):
        ProbeRequest(stage=GENERATE, tp=2, devices=(0, 1, 2), batch=4, iterations=1)


def _generation_timings(state, tp: int) -> tuple[StageTiming, ...]:
    """Generation on ``tp`` over the 16 slots for a few response lengths, timed in the HIDDEN world."""
    out = []
    for mean in (128, 256, 512):
        w = work(batch=256, prompt=128, mean=mean, high=2 * mean)
        layout = Layout.contiguous(tp=tp, dp=DEVICES // tp)
        raw = np.array(list(estimate(GENERATE, layout, w, MID, state.profile).raw.values()))
        out.append(
            StageTiming(stage=GENERATE, layout=layout, seconds=float(raw @ HIDDEN.as_array()), workload=w)
        )
    return tuple(out)


def _timed_probes(state) -> tuple[ProbeTiming, ...]:
    """A probe at every degree, as the HIDDEN world times it."""
    out = []
    for tp in (2, 4, 8):
        r = ProbeRequest(
            stage=GENERATE, tp=tp, devices=tuple(range(tp)), batch=256 * tp // DEVICES, iterations=16
        )
        terms = np.array(probe.sample(ProbeTiming(request=r, seconds=1.0), state).terms)
        out.append(ProbeTiming(request=r, seconds=float(terms @ HIDDEN.as_array())))
    return tuple(out)


def test_a_probe_sample_loads_only_generations_collective_rows() -> None:
    state = fresh()
    for timed in _timed_probes(state):
        terms = dict(zip(TERMS, probe.sample(timed, state).terms, strict=True))
        assert terms["tp_calls_generate"] > 0 and terms["tp_comm_generate"] > 0
        assert all(v == 0 for k, v in terms.items() if k not in probe.ROWS)


def test_probes_price_a_generation_degree_the_plan_in_force_never_ran() -> None:
    """Timings at tp=4 only cannot say how the collectives grow with the degree; with probes at 2, 4
    and 8 (four rounds of them, as every probe_every steps) the calibrated tp=8 prediction lands near
    the truth, and the passes' tp_comm stays put."""
    state = fresh()
    seen = _generation_timings(state, 4) * 4
    without = calibrate(observe(DEVICES, 80 * GB, W, timings=seen), state)
    with_probes = calibrate(
        observe(DEVICES, 80 * GB, W, timings=seen, probes=_timed_probes(state) * 4), state
    )
    target = _generation_timings(state, 8)[1]
    truth = target.seconds

    def predicted(s) -> float:
        return estimate(GENERATE, target.layout, target.workload, MID, s.profile, s.scales).seconds

    err_without = abs(predicted(without) / truth - 1)
    err_with = abs(predicted(with_probes) / truth - 1)
    assert err_with < 0.06 and err_with < err_without / 5, (err_with, err_without)  # 4.5% vs 38%
    assert with_probes.scales.tp_comm == without.scales.tp_comm == 1.0  # no pass was timed
    assert len(with_probes.samples) == len(without.samples) + 12
