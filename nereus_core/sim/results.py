"""From per-step records to the summary: per run, per strategy over seeds, and Nereus against the rest.

Boundary: lists of step records (``engine.simulate``) in, JSON-ready dicts out.
Everything here is deterministic in the records; the measured wall time of the
controller (``decide_wall_s``) is left out of the summary so that the same config
and seed always give the same summary (it stays in the step records).

Per run (one trace, strategy and seed):
- ``total_s``: every step's latency plus every transition, periodic checkpoint and lost step.
- ``mean_step_s``: the mean step latency (stages + weight sync + controller time, and for a
  step whose plan did not fit, its failed attempt and a restart: ``restart_s_total``);
  ``mean_step_with_transitions_s``: the same with every transition's and checkpoint's time spread
  over the steps.
- ``checkpoint_s_total``, ``checkpoint_overhead_frac``: the periodic checkpoints' time (Nereus's
  runtime writes one every ``snapshot_every`` steps, the peers at their documented cadence) and its
  share; ``lost_s_total``: the steps rerun after devices were lost without notice (``loop``);
  ``relaunches``, ``relaunch_s_total``: a peer's stop, restart and reload when its devices change.
- ``throughput_tokens_per_s``: tokens (prompt + response of every sequence) / total_s.
- ``transitions``: moves that change a layout's degrees, slots or placement (switches
  and DP rescales), and how many of them the devices, memory or a gain caused
  (``transitions_devices``, ``_memory``, ``_gain``); ``retunes``: controller switches
  that only change micro-batch counts.
  ``transition_s_total`` counts both; ``transition_overhead_frac`` = it / total_s.
- ``controller_s_total`` and ``controller_overhead_frac``: decision time charged.
- ``floor_step_s``: the mean of what no plan of any shape can beat at each step in this world
  (``World.floor_s``); ``step_over_floor`` = ``mean_step_s`` / it: no strategy can take a mean step
  more than that factor below this one's.
- ``prediction_error_*``: |calibrated predicted step - true step| / true step, mean over
  steps [0, 5) and [45, 55) (adaptive strategy only).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from nereus_core.sim.loop import TRANSITION_KINDS

FIELDS = (
    "mean_step_s",
    "mean_step_with_transitions_s",
    "restart_s_total",
    "checkpoint_s_total",
    "checkpoint_overhead_frac",
    "lost_s_total",
    "relaunches",
    "relaunch_s_total",
    "throughput_tokens_per_s",
    "transitions",
    "transition_s_total",
    "transition_overhead_frac",
    "transitions_devices",
    "transitions_memory",
    "transitions_gain",
    "retunes",
    "controller_calls",
    "controller_s_total",
    "controller_overhead_frac",
    "infeasible_steps",
    "total_s",
    "tokens",
    "prediction_error_first5",
    "prediction_error_45_55",
    "floor_step_s",
    "step_over_floor",
)


def _mean_error(records: Sequence[dict], lo: int, hi: int) -> float | None:
    errs = [
        abs(r["predicted_step_s"] - r["true_step_s"]) / r["true_step_s"]
        for r in records
        if lo <= r["step"] < hi and not math.isnan(r["predicted_step_s"])
    ]
    return statistics.fmean(errs) if errs else None


def cause(record: dict) -> str:
    """Why a transition ran: ``devices`` (the device set changed), ``memory`` (the plan stopped
    fitting) or ``gain`` (the controller admitted a faster plan)."""
    reason = record["reason"]
    moved = record["move"] in ("rescale", "relaunch")
    if moved or reason.startswith("device set changed") or "beyond the" in reason:
        return "devices"
    if "needs" in reason or "peaked" in reason:
        return "memory"
    return "gain"


def summarize_run(records: Sequence[dict]) -> dict[str, float | int | None]:
    """The summary fields of one (trace, strategy, seed) run."""
    steps = sum(r["step_s"] for r in records)
    transition_s = sum(r["transition_s"] for r in records)
    checkpoint_s = sum(r.get("checkpoint_s", 0.0) for r in records)
    lost = sum(r.get("lost_s", 0.0) for r in records)
    total = steps + transition_s + checkpoint_s + lost
    tokens = sum(r["tokens"] for r in records)
    controller = sum(r["decide_s"] for r in records)
    # Runs kept by a sweep before the floor was recorded have none.
    floor = None if any("floor_step_s" not in r for r in records) else sum(r["floor_step_s"] for r in records)
    return {
        "steps": len(records),
        "mean_step_s": steps / len(records),
        "mean_step_with_transitions_s": total / len(records),
        "restart_s_total": sum(r.get("restart_s", 0.0) for r in records),
        "checkpoint_s_total": checkpoint_s,
        "checkpoint_overhead_frac": checkpoint_s / total,
        "lost_s_total": lost,
        "relaunches": sum(r["move"] == "relaunch" for r in records),
        "relaunch_s_total": sum(r["transition_s"] for r in records if r["move"] == "relaunch"),
        "throughput_tokens_per_s": tokens / total,
        "transitions": sum(r["move"] in TRANSITION_KINDS for r in records),
        "transition_s_total": transition_s,
        **{
            f"transitions_{c}": sum(r["move"] in TRANSITION_KINDS and cause(r) == c for r in records)
            for c in ("devices", "memory", "gain")
        },
        "transition_overhead_frac": transition_s / total,
        "retunes": sum(r["move"] == "retune" for r in records),
        "controller_calls": sum(r["decide_calls"] for r in records),
        "controller_s_total": controller,
        "controller_overhead_frac": controller / total,
        "infeasible_steps": sum(not r["fits"] for r in records),
        "total_s": total,
        "tokens": tokens,
        "prediction_error_first5": _mean_error(records, 0, 5),
        "prediction_error_45_55": _mean_error(records, 45, 55),
        "floor_step_s": None if floor is None else floor / len(records),
        "step_over_floor": None if floor is None else steps / floor,
    }


def _mean(values: Iterable[float | int | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def aggregate(runs: dict[int, dict]) -> dict:
    """Mean of every field over seeds, plus the per-seed values."""
    out: dict = {f: _mean(r[f] for r in runs.values()) for f in FIELDS}
    out["steps"] = next(iter(runs.values()))["steps"]
    out["by_seed"] = {str(seed): runs[seed] for seed in sorted(runs)}
    return out


def compare(per_strategy: dict[str, dict], adaptive: str) -> dict[str, dict]:
    """``adaptive`` against every other strategy of one trace, paired by seed, then averaged:
    throughput ratio (adaptive / other) and mean step latency change (adaptive / other - 1), without
    and with transition time."""
    if adaptive not in per_strategy:
        return {}
    mine = per_strategy[adaptive]["by_seed"]
    out = {}
    for name, other in per_strategy.items():
        if name == adaptive:
            continue
        seeds = [s for s in mine if s in other["by_seed"]]
        ratio = [
            mine[s]["throughput_tokens_per_s"] / other["by_seed"][s]["throughput_tokens_per_s"] for s in seeds
        ]
        latency = [mine[s]["mean_step_s"] / other["by_seed"][s]["mean_step_s"] - 1.0 for s in seeds]
        key = "mean_step_with_transitions_s"
        with_moves = [mine[s][key] / other["by_seed"][s][key] - 1.0 for s in seeds]
        out[name] = {
            "throughput_ratio": _mean(ratio),
            "step_latency_change": _mean(latency),
            "step_latency_change_with_transitions": _mean(with_moves),
            "seeds": len(seeds),
        }
    return out


def build_summary(
    runs: Iterable[tuple[str, str, int, dict]],
    *,
    traces: dict[str, dict],
    adaptive: str | None,
    header: dict,
) -> dict:
    """The summary.json content: per trace, per strategy (mean over seeds) and the comparisons."""
    nested: dict[str, dict[str, dict[int, dict]]] = {}
    for trace, strategy, seed, summary in runs:
        nested.setdefault(trace, {}).setdefault(strategy, {})[seed] = summary
    out = dict(header)
    out["traces"] = {}
    for trace, strategies in nested.items():
        per = {name: aggregate(strategies[name]) for name in strategies}
        out["traces"][trace] = {
            **traces.get(trace, {}),
            "strategies": per,
            "compare": compare(per, adaptive) if adaptive else {},
        }
    return out
