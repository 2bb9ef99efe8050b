"""nereus_core.cost: the terms calibration can tell apart (generation's TP collectives, each kind's
fixed cost), the raw rows each stage kind loads, and old scale records read back."""

from __future__ import annotations

import numpy as np
import pytest

from nereus_core.config import LLAMA_3_8B as LLAMA_8B
from nereus_core.config import Workload
from nereus_core.cost.calibration import CalibrationSettings, Sample, fit_scales
from nereus_core.cost.hardware import H100_SXM, LEGACY_TERMS, split_legacy_terms
from nereus_core.cost.stage_cost import TERMS, Scales, estimate
from nereus_core.layout import Layout

# Without the per-call fixed costs (13.8 s a generation call) that would swamp the terms fitted here.
BARE = H100_SXM.model_copy(update={"generate_call_s": 0.0, "infer_call_s": 0.0, "train_call_s": 0.0})
WORK = Workload(batch=512, prompt_len=256, response_mean=512, response_high=1024, response_max=2048)
STAGES = ("actor/generate", "critic/infer", "actor/train")
KIND_ROWS = {
    "actor/generate": ("tp_comm_generate", "tp_calls_generate", "dispatch_generate"),
    "critic/infer": ("tp_comm", "tp_calls", "dispatch_infer"),
    "actor/train": ("tp_comm", "tp_calls", "dispatch_train"),
}


def _samples(
    hidden: Scales, tps: dict[str, tuple[int, ...]], batches=(256, 512), profile=BARE
) -> list[Sample]:
    """Noise-free timings of each stage at its TP degrees on 32 slots, under ``hidden`` scales, for a
    few batches and response lengths (so per-call, per-iteration and per-token costs differ)."""
    out = []
    for stage, degrees in tps.items():
        for tp in degrees:
            for batch in batches:
                for scale in (0.5, 1.0, 2.0):
                    w = WORK.model_copy(
                        update={
                            "batch": batch,
                            "response_mean": WORK.response_mean * scale,
                            "response_high": int(WORK.response_high * scale),
                            "response_max": int(WORK.response_longest * scale),
                        }
                    )
                    layout = Layout.contiguous(tp=tp, dp=32 // tp)
                    raw = np.array(list(estimate(stage, layout, w, LLAMA_8B, profile).raw.values()))
                    out.append(Sample(tuple(raw), float(raw @ hidden.as_array())))
    return out


def test_each_kind_loads_only_its_own_rows() -> None:
    layout = Layout.contiguous(tp=2, dp=4)
    for stage, own in KIND_ROWS.items():
        raw = estimate(stage, layout, WORK, LLAMA_8B, H100_SXM).raw
        others = {r for rows in KIND_ROWS.values() for r in rows} - set(own)
        assert all(raw[r] == 0 for r in others), stage
        assert all(raw[r] > 0 for r in own), stage


def test_calibration_fits_a_generation_only_tp_error_without_moving_trains() -> None:
    """Generation's collectives cost 0.3x their prior, the passes' exactly their prior: the fit finds
    the first and leaves the second, which one shared scale could not."""
    hidden = Scales(tp_comm_generate=0.3)
    samples = _samples(hidden, {s: (1, 2, 4, 8) for s in STAGES})
    weak = CalibrationSettings(prior=1e-4, iterations=300)  # noise-free: let the data speak
    fitted = Scales.from_array(fit_scales(samples, weak))
    assert fitted.tp_comm_generate == pytest.approx(0.3, rel=0.1)
    assert fitted.tp_comm == pytest.approx(1.0, rel=0.05)
    assert fitted.compute == pytest.approx(1.0, rel=0.05)
    # One scale for both (the terms before the split) must compromise and mis-price the passes.
    shared = [Sample(_merge(s.terms), s.seconds) for s in samples]
    one = fit_scales(shared, weak)
    assert one[LEGACY_TERMS.index("tp_comm")] < 0.95  # the passes' collectives priced 5%+ too cheap


def _merge(terms: tuple[float, ...]) -> tuple[float, ...]:
    """A raw vector as the legacy terms had it: one tp_comm row, one dispatch row."""
    t = dict(zip(TERMS, terms, strict=True))
    merged = {
        **t,
        "tp_comm": t["tp_comm"] + t["tp_calls"] + t["tp_comm_generate"] + t["tp_calls_generate"],
        "dispatch": t["dispatch_generate"] + t["dispatch_infer"] + t["dispatch_train"],
    }
    return tuple(merged[k] for k in LEGACY_TERMS)


def test_calibration_separates_the_fixed_cost_of_each_kind_from_compute() -> None:
    """An infer call costs 1.5x its prior, a train call 0.7x, compute is right: each kind's row moves
    its own way and compute stays (one shared dispatch scale would push compute instead)."""
    hidden = Scales(dispatch_infer=1.5, dispatch_train=0.7)
    samples = _samples(hidden, {s: (1, 2) for s in STAGES}, batches=(64, 256, 1024), profile=H100_SXM)
    fitted = Scales.from_array(fit_scales(samples, CalibrationSettings(prior=0.01)))
    assert fitted.dispatch_infer == pytest.approx(1.5, rel=0.05)
    assert fitted.dispatch_train == pytest.approx(0.7, rel=0.05)
    assert fitted.dispatch_generate == pytest.approx(1.0, rel=0.05)
    assert fitted.compute == pytest.approx(1.0, rel=0.05)


def test_scale_records_from_before_the_split_read_back() -> None:
    old = dict(zip(LEGACY_TERMS, (0.5, 0.9, 2.0, 1.1, 0.8, 1.0, 0.7, 1.4), strict=True))
    scales = Scales.model_validate(old)
    # one scale covered every TP collective (calls and ring, generation and passes)
    assert scales.tp_comm == scales.tp_comm_generate == scales.tp_calls == scales.tp_calls_generate == 2.0
    assert scales.dispatch_generate == scales.dispatch_infer == scales.dispatch_train == 1.4
    assert scales.compute == 0.5 and scales.overhead == 0.7
    # New records are read as written: tp_comm alone is the passes' only.
    assert Scales(tp_comm=2.0).tp_comm_generate == Scales(tp_comm=2.0).tp_calls == 1.0
    assert split_legacy_terms({"compute": 2.0}) == {"compute": 2.0}
    profile = H100_SXM.model_validate({**H100_SXM.model_dump(), "term_scales": {"dispatch": 2.0}})
    assert profile.term_scales == {"dispatch_generate": 2.0, "dispatch_infer": 2.0, "dispatch_train": 2.0}
