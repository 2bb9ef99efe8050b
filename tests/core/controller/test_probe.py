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
    gen, train = d.plan.layouts[GENERATE], d.plan.layouts[probe.PASS_STAGE]
    valid = [t for t in (2, 4, 8) if MID.tp_error(t) is None]
    assert 4 in valid and {r.stage for r in d.probes} == {GENERATE, probe.PASS_STAGE}
    for stage, layout in ((GENERATE, gen), (probe.PASS_STAGE, train)):
        mine = [r for r in d.probes if r.stage == stage]
        assert [r.tp for r in mine] == [t for t in valid if t <= len(layout.devices)]
        assert all(r.devices == layout.devices[: r.tp] for r in mine)
    for r in d.probes:
        if r.stage == GENERATE:  # one replica's batch at that degree, one token a step
            assert r.batch == math.ceil(W.batch / (len(gen.devices) // r.tp)) and r.seq == 1
        else:  # one micro-batch of the plan's train layout, over the mean sequence
            assert r.batch == math.ceil(math.ceil(W.batch / train.dp) / train.micro_batches)
            assert r.seq == W.prompt_len + round(W.response_mean) and r.iterations == 1
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


def test_a_probe_sample_loads_only_its_stages_collective_rows() -> None:
    state = fresh()
    passes = ProbeRequest(stage=probe.PASS_STAGE, tp=4, devices=(0, 1, 2, 3), batch=2, iterations=1, seq=384)
    for timed in (*_timed_probes(state), ProbeTiming(request=passes, seconds=0.01)):
        own = probe.GENERATE_ROWS if timed.request.stage == GENERATE else probe.PASS_ROWS
        terms = dict(zip(TERMS, probe.sample(timed, state).terms, strict=True))
        assert all(terms[k] > 0 for k in own)
        assert all(v == 0 for k, v in terms.items() if k not in own)


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


def test_pass_probes_price_a_train_degree_the_plan_in_force_never_ran() -> None:
    """The same for the passes: actor/train timed at tp=2 only, a world whose collective calls cost
    10x the prior's first hop and whose ring 0.7x; probes of one micro-batch forward at 2, 4 and 8
    bring the tp=8 prediction near the truth (13% -> 4% error). The calls are a small share of a
    pass probe (its buffers are large), so it takes more rounds: sixteen, 160 steps of a job."""
    hidden = Scales(tp_calls=10.0, tp_comm=0.7)
    state = fresh()

    def timing(tp: int, mean: float) -> StageTiming:
        w = work(batch=256, prompt=128, mean=mean, high=int(2 * mean))
        layout = Layout.contiguous(tp=tp, dp=DEVICES // tp, micro_batches=8)
        raw = np.array(list(estimate(probe.PASS_STAGE, layout, w, MID, state.profile).raw.values()))
        return StageTiming(
            stage=probe.PASS_STAGE, layout=layout, seconds=float(raw @ hidden.as_array()), workload=w
        )

    seen = tuple(timing(2, m) for m in (128, 256, 512)) * 4
    probes = []
    for tp in (2, 4, 8):
        r = ProbeRequest(
            stage=probe.PASS_STAGE, tp=tp, devices=tuple(range(tp)), batch=4, iterations=1, seq=384
        )
        terms = np.array(probe.sample(ProbeTiming(request=r, seconds=1.0), state).terms)
        probes.append(ProbeTiming(request=r, seconds=float(terms @ hidden.as_array())))
    without = calibrate(observe(DEVICES, 80 * GB, W, timings=seen), state)
    with_probes = calibrate(observe(DEVICES, 80 * GB, W, timings=seen, probes=tuple(probes) * 16), state)
    target = timing(8, 256)

    def error(s) -> float:
        e = estimate(probe.PASS_STAGE, target.layout, target.workload, MID, s.profile, s.scales).seconds
        return abs(e / target.seconds - 1)

    assert error(with_probes) < 0.05 and error(with_probes) < error(without) / 3, (
        error(with_probes),
        error(without),
    )
    assert with_probes.scales.tp_comm_generate == 1.0  # no generation was timed
