"""What the calibrated cost model still misses about one shape of a model-stage (its tp and pp), kept
from the stage timings of any plan and applied to a candidate that shares the shape."""

from __future__ import annotations

import pytest

from nereus_core.controller import history
from nereus_core.controller.state import ShapeSample
from nereus_core.cost.stage_cost import Scales
from nereus_core.layout import Layout

N = len(Scales().as_array())


def _raw(decode: float) -> tuple[float, ...]:
    raw = [0.0] * N
    raw[1] = decode  # the decode term (Scales' second field)
    return tuple(raw)


def test_a_shape_s_residual_is_the_median_of_its_last_timings_re_priced_with_today_s_scales() -> None:
    tp2 = history.shape_of("actor/generate", Layout(tp=2, dp=4, devices=tuple(range(8))))
    tp8 = history.shape_of("actor/generate", Layout(tp=8, devices=tuple(range(8))))
    assert tp2 == "actor/generate@tp2.pp1" and tp2 != tp8
    old = [ShapeSample(shape=tp2, raw=_raw(1.0), seconds=9.0)]  # pushed out by the five below
    recent = [ShapeSample(shape=tp2, raw=_raw(1.0), seconds=s) for s in (2.4, 2.6, 2.5, 9.0, 2.5)]
    samples = [*old, *recent, ShapeSample(shape=tp8, raw=_raw(1.0), seconds=1.0)]
    residuals = history.shape_residuals(samples, Scales())
    assert residuals == {tp2: 2.5, tp8: 1.0}
    # Calibrated to decode twice as slow everywhere, the cost model still misses tp2 by 1.25x.
    rescaled = history.shape_residuals(samples, Scales(decode=2.0))
    assert rescaled[tp2] == pytest.approx(1.25) and rescaled[tp8] == pytest.approx(0.5)
    kept = history.push_shapes(samples, samples * 100)
    assert len(kept) == history.KEPT_SHAPES and kept[-1] == samples[-1]
