"""The candidate layouts of one model-stage and their table of seconds and bytes (the plan search's input).

Boundary: which degrees a stage may take on up to N slots (those ``plan.layout_problems``
admits) and, for one first slot, every candidate's calibrated seconds and memory, vectorized
(``cost.terms.stage_tables``). ``controller.search`` builds them once per call and combines them.
"""

from __future__ import annotations

import numpy as np

from nereus_core.config import ModelConfig, Workload
from nereus_core.controller.pool_solver import StageTable
from nereus_core.cost.hardware import HardwareProfile
from nereus_core.cost.stage_cost import Scales
from nereus_core.cost.terms import PERSISTENT, contiguous_geometry, model_stats, split_arrays, stage_tables
from nereus_core.plan import GENERATE, stage_rows


def _powers(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def candidates(
    stage: str, model: ModelConfig, profile: HardwareProfile, work: Workload, max_world: int
) -> tuple[np.ndarray, ...]:
    """Arrays (tp, pp, dp, m, f1b, rc, z3) of the layouts considered for ``stage`` on up to ``max_world``
    slots: the degrees ``plan.layout_problems`` admits (tp/pp shard the model, dp*m divides the stage's
    rows); a train stage's pipelines under either schedule (``f1b``: 1F1B, else GPipe), each of its
    layouts with and without recomputation (``rc``; always with it under the model's launch flag), and
    each of its data-parallel layouts without a pipeline sharded ``full`` too (``z3``: ZeRO-3)."""
    batch = stage_rows(stage, work.batch, work.mini_batches)
    tps = [t for t in _powers(min(profile.devices_per_node, max_world)) if model.tp_error(t) is None]
    layers = model.num_hidden_layers
    pps = [p for p in range(1, min(layers, max_world) + 1) if (p & (p - 1) == 0 or layers % p == 0)]
    pps = [p for p in pps if model.pp_error(p) is None]
    dps = [d for d in range(1, min(batch, max_world) + 1) if batch % d == 0]
    waves = profile.max_generate_waves if stage == GENERATE else batch
    grid = np.array(np.meshgrid(tps, pps, dps, _powers(min(waves, batch)), indexing="ij")).reshape(4, -1)
    tp, pp, dp, m = grid
    keep = (tp * pp * dp <= max_world) & ((batch // dp) % m == 0)
    tp, pp, dp, m = tp[keep], pp[keep], dp[keep], m[keep]
    f1b = np.zeros_like(tp, dtype=bool)
    rc = np.full_like(tp, model.gradient_checkpointing, dtype=bool)
    if stage.endswith("/train"):  # only a backward has a schedule; a pipeline of one micro-batch has none
        again = (pp > 1) & (m > 1)
        tp, pp, dp, m, rc = (np.concatenate([a, a[again]]) for a in (tp, pp, dp, m, rc))
        f1b = np.concatenate([f1b, np.ones(int(again.sum()), dtype=bool)])
        if not model.gradient_checkpointing:  # every train layout also recomputing
            tp, pp, dp, m, f1b = (np.concatenate([a, a]) for a in (tp, pp, dp, m, f1b))
            rc = np.concatenate([rc, np.ones_like(rc)])
    z3 = np.zeros_like(tp, dtype=bool)
    if stage.endswith("/train"):
        again = (pp == 1) & (dp > 1)
        tp, pp, dp, m, f1b, rc = (np.concatenate([a, a[again]]) for a in (tp, pp, dp, m, f1b, rc))
        z3 = np.concatenate([z3, np.ones(int(again.sum()), dtype=bool)])
    return tp, pp, dp, m, f1b, rc, z3


def build_table(
    stage: str,
    model: ModelConfig,
    work: Workload,
    profile: HardwareProfile,
    scales: Scales,
    *,
    first: int,
    max_world: int,
    base: tuple[np.ndarray, ...] | None = None,
) -> StageTable:
    """Every candidate of ``stage`` placed from slot ``first``; ``base`` reuses the candidate
    degrees and their pipeline split (they do not depend on ``first``)."""
    stats = model_stats(model)
    if base is None:
        tp, pp, dp, m, f1b, rc, z3 = candidates(stage, model, profile, work, max_world)
        base = (tp, pp, dp, m, f1b, rc, z3, *split_arrays(stats, tp, pp))
    tp, pp, dp, m, f1b, rc, z3, *split = base
    geo = contiguous_geometry(stats, profile, tp, pp, dp, m, first, split=tuple(split), f1b=f1b, rc=rc, z3=z3)
    raw, mem = stage_tables(stage.partition("/")[2], geo, work, stats, profile)  # type: ignore[arg-type]
    persistent, transient = mem[PERSISTENT].sum(axis=0), mem[~PERSISTENT].sum(axis=0)
    return StageTable(tp, pp, dp, m, f1b, rc, z3, scales.as_array() @ raw, persistent, transient)
