"""The calibration benchmark's model, workloads and layouts, and what its timings say: the
controller's calibration fitted to the timings of two layouts, and its errors on the others.

Boundary: pure analysis of timings already measured (``bench_calibration.measure``, or a file it
saved); nothing here starts a device pool.
"""

from __future__ import annotations

import statistics
from typing import Any

from nereus_core.config import ModelConfig, Workload
from nereus_core.controller.decide import (
    ControllerSettings,
    ControllerState,
    Observation,
    StageTiming,
    observe,
)
from nereus_core.cost.calibration import CalibrationSettings
from nereus_core.cost.hardware import CPU_WORKERS
from nereus_core.cost.stage_cost import estimate
from nereus_core.layout import Layout
from nereus_core.plan import PPO_STAGES, models_for

CONFIG = ModelConfig(num_attention_heads=8, num_key_value_heads=4)
WORKLOAD = Workload(batch=8, prompt_len=16, response_mean=16, response_high=16)
PROFILE_WORKLOAD = Workload(batch=4, prompt_len=24, response_mean=8, response_high=8)
MICRO_ONLY = CPU_WORKERS.model_copy(update={"term_scales": {}})
LAYOUTS = [
    (1, 1, 1),
    (2, 1, 1),
    (1, 2, 1),
    (1, 1, 2),
    (4, 1, 1),
    (2, 2, 1),
    (2, 1, 2),
    (1, 2, 2),
    (1, 1, 4),
    (1, 4, 1),
]
CALIBRATE_ON = [(2, 2, 1), (1, 1, 2)]
STAGES = {"generate": "actor/generate", "forward": "reference/infer", "train": "actor/train"}


def layout_of(tp: int, pp: int, dp: int) -> Layout:
    return Layout.contiguous(tp=tp, pp=pp, dp=dp, micro_batches=2 if pp > 1 else 1)


def _samples(raw: dict[str, Any], profile: Any, only: list | None = None) -> list[StageTiming]:
    return [
        StageTiming(stage=stage, layout=layout_of(*row["layout"]), seconds=t)
        for row in raw["rows"]
        if only is None or tuple(row["layout"]) in only
        for kind, stage in STAGES.items()
        for t in row[kind]
    ]


def calibrate(raw: dict[str, Any], profile: Any, only: list | None, prior: float | None = None) -> Any:
    """The controller's calibration (``observe``) on the timings of ``only`` layouts (all if None)."""
    settings = ControllerSettings()
    if prior is not None:
        settings = settings.model_copy(update={"calibration": CalibrationSettings(prior=prior)})
    state = ControllerState.initial(models_for(CONFIG), profile, settings, stages=PPO_STAGES)
    work = Workload(**raw["workload"])
    obs = Observation(
        step=0,
        remaining_steps=1,
        devices=4,
        memory_per_device=2 * 1024**3,
        workload=work,
        timings=tuple(_samples(raw, profile, only)),
    )
    return observe(obs, state)


def _pct(predicted: float, measured: float) -> float:
    return round(100 * abs(predicted - measured) / measured, 1)


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    """Calibrate on CALIBRATE_ON, predict every other layout; memory predicted vs measured."""
    work = Workload(**raw["workload"])
    calibrated = calibrate(raw, CPU_WORKERS, CALIBRATE_ON)
    model = calibrated.models["actor"]
    predictions, memory = [], []
    for row in raw["rows"]:
        layout = layout_of(*row["layout"])
        for kind, stage in STAGES.items():
            measured = statistics.median(row[kind])
            micro = estimate(stage, layout, work, model, MICRO_ONLY).seconds
            prior = estimate(stage, layout, work, model, CPU_WORKERS).seconds
            fitted = estimate(stage, layout, work, model, CPU_WORKERS, calibrated.scales).seconds
            predictions.append(
                {
                    "layout": layout.key,
                    "stage": kind,
                    "calibration_layout": tuple(row["layout"]) in CALIBRATE_ON,
                    "measured_s": round(measured, 5),
                    "calibrated_s": round(fitted, 5),
                    "err_pct": _pct(fitted, measured),
                    "profile_err_pct": _pct(prior, measured),
                    "micro_err_pct": _pct(micro, measured),
                }
            )
        mem = estimate("actor/train", layout, work, model, CPU_WORKERS).memory
        actual = max(row["bytes"], key=lambda b: b["weights"] + b["optimizer"])
        held = actual["weights"] + actual["optimizer"]
        memory.append(
            {
                "layout": layout.key,
                "predicted": {"weights": mem.weights, "optimizer": mem.optimizer, "gradients": mem.gradients},
                "actual_busiest_device": actual,
                "predicted_weights_plus_optimizer": mem.persistent,
                "actual_weights_plus_optimizer": held,
                "err_pct": _pct(mem.persistent, held),
            }
        )
    unseen = [p for p in predictions if not p["calibration_layout"]]
    return {
        "benchmark": "calibration",
        "workload": work.model_dump(),
        "repeats": raw["repeats"],
        "calibrated_on": [list(x) for x in CALIBRATE_ON],
        "predicted": f"{len(unseen)} stage timings on {len({p['layout'] for p in unseen})} other layouts",
        "median_abs_pct_error": statistics.median(p["err_pct"] for p in unseen),
        "median_abs_pct_error_profile_only": statistics.median(p["profile_err_pct"] for p in unseen),
        "median_abs_pct_error_microbenchmarks_only": statistics.median(p["micro_err_pct"] for p in unseen),
        "per_stage_median_abs_pct_error": {
            k: statistics.median(p["err_pct"] for p in unseen if p["stage"] == k) for k in STAGES
        },
        "scales": {k: round(v, 3) for k, v in calibrated.scales.model_dump().items()},
        "predictions": predictions,
        "memory_weights_plus_optimizer_median_abs_pct_error": statistics.median(m["err_pct"] for m in memory),
        "memory_bytes": memory,
    }
