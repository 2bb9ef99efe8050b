"""Fit the cost model's fixed costs per stage call for 7-8B models on published 7B stage timings.

The H100 profile's ``generate_call_s``, ``infer_call_s`` and ``train_call_s`` were fitted on verl's
Qwen2.5-0.5B logs (benchmarks/validate_cost_model.py); a 7B job's stack pays other fixed costs. This
fits them with the cost model's own formulas (``stage_cost.estimate`` with those constants at 0) on
the same published runs the world's 7-8B constants come from (benchmarks/fit_world_7b.py: V1 and V2
fitted, F1 held out), so the two share data but no formula. Least squares: a pass's published
seconds are its kind's constant plus its compute term over a fitted share of the FLOP efficiency
(``flops_efficiency``) plus the rest of the estimate; a generation's constant is the mean of
(published - the bare estimate). Constants floor at 0.

Prints JSON: the fitted constants, and per stage the published seconds, the bare estimate and the
estimate with the fitted constants.

    python -m benchmarks.fit_cost_prior_7b
"""

from __future__ import annotations

import json

import numpy as np

from benchmarks import fit_world_7b as fw
from nereus_core.config import ModelConfig, Workload
from nereus_core.cost.hardware import H100_SXM, HardwareProfile
from nereus_core.cost.stage_cost import estimate
from nereus_core.layout import Layout
from nereus_core.plan import models_for

FIXED = ("generate_call_s", "infer_call_s", "train_call_s")
CONFIGS = {  # config.json of each published run's model
    "V1": ModelConfig(  # deepseek-ai/deepseek-llm-7b-chat
        vocab_size=102400,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=30,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    ),
    "V2": ModelConfig(  # Qwen/Qwen2-7B-Instruct
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
    ),
}
CONFIGS["F1"] = CONFIGS["V2"]
STAGE_OF = {  # published stage -> the cost model's model-stage
    "gen": "actor/generate",
    "old_log_prob": "actor/infer",
    "ref": "reference/infer",
    "values": "critic/infer",
    "update_critic": "critic/train",
    "update_actor": "actor/train",
}


def _workload(st: fw.Stage) -> Workload:
    s = st.stats
    return Workload(
        batch=s.batch,
        prompt_len=max(round(s.prompt_mean), 1),
        response_mean=s.response_mean,
        response_high=max(s.response_max, round(s.response_mean)),
        response_max=max(s.response_max, round(s.response_mean)),
    )


def _estimate(st: fw.Stage, profile: HardwareProfile):
    stage = STAGE_OF[st.name.split("@")[0]]
    shape = st.shape
    micro = 1 if st.kind == "generate" else shape.micro_batches
    layout = Layout.contiguous(tp=shape.tp, pp=shape.pp, dp=shape.dp, micro_batches=micro)
    model = models_for(CONFIGS[st.run])[stage.split("/")[0]]
    return estimate(stage, layout, _workload(st), model, profile)


def predicted_s(st: fw.Stage, profile: HardwareProfile) -> float:
    """``stage_cost.estimate`` (no calibration) of one published stage on its layout."""
    return _estimate(st, profile).seconds


def fit(rows: list[fw.Stage]) -> dict[str, float]:
    bare = H100_SXM.model_copy(update=dict.fromkeys(FIXED, 0.0))
    passes = [r for r in rows if r.kind != "generate"]
    raws = [_estimate(r, bare).raw for r in passes]
    compute = np.array([raw["compute"] for raw in raws])
    rest = np.array([sum(v for k, v in raw.items() if k != "compute") for raw in raws])
    is_train = np.array([r.kind == "train" for r in passes], dtype=float)
    design = np.column_stack([1.0 - is_train, is_train, compute])
    y = np.array([r.seconds for r in passes]) - rest
    (infer, train, slower), *_ = np.linalg.lstsq(design, y, rcond=None)
    efficiency = float(np.clip(H100_SXM.flops_efficiency / max(float(slower), 1e-9), 0.05, 1.0))
    out = {"infer_call_s": max(float(infer), 0.0), "train_call_s": max(float(train), 0.0)}
    out["flops_efficiency"] = efficiency
    with_passes = bare.model_copy(update={"flops_efficiency": efficiency})
    gen = [r.seconds - predicted_s(r, with_passes) for r in rows if r.kind == "generate"]
    out["generate_call_s"] = max(float(np.mean(gen)), 0.0)
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    fitted_rows = [r for run in fw.FITTED_RUNS for r in getattr(fw, f"_{run.lower()}")()]
    held_rows = [r for run in fw.HELD_OUT_RUNS for r in getattr(fw, f"_{run.lower()}")()]
    constants = fit(fitted_rows)
    bare = H100_SXM.model_copy(update=dict.fromkeys(FIXED, 0.0))
    fitted = H100_SXM.model_copy(update=constants)
    rows = []
    for r in fitted_rows + held_rows:
        b, f = predicted_s(r, bare), predicted_s(r, fitted)
        rows.append(
            {
                "run": r.run,
                "stage": r.name,
                "held_out": r.run in fw.HELD_OUT_RUNS,
                "published_s": r.seconds,
                "bare_s": round(b, 3),
                "fitted_s": round(f, 3),
                "fitted_over_published": round(f / r.seconds, 3),
                "prior_0.5b_s": round(predicted_s(r, H100_SXM), 3),
            }
        )
    used = {k: getattr(H100_SXM, k) for k in (*FIXED, "flops_efficiency")}
    print(json.dumps({"fitted_7b": constants, "prior_0.5b": used, "stages": rows}, indent=1))


if __name__ == "__main__":
    main()
