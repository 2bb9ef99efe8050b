"""The simulated world's memory (``sim/memory.py``): fitted on published peaks, and its own rules."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import fit_world_memory as fm
from nereus_core.sim import memory
from nereus_core.sim.stage_world import Shape


def test_the_stored_activation_bytes_are_the_fit_and_the_published_peaks_hold() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.fit_world_memory"], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout)
    assert result["activation_bytes"] == pytest.approx(memory.ACTIVATION_BYTES, abs=0.01)
    runs = {r["run"]: r for r in result["runs"]}
    assert all(abs(runs[r]["ratio"] - 1) < 0.05 for r in ("M1", "M2")), runs  # fitted: 0.99, 1.01
    assert runs["M3"]["ratio"] < 1.0  # an upper bound (the allocator near the card's limit): 0.79


def test_no_pipeline_holds_one_micro_batch_and_gpipe_holds_them_all() -> None:
    lengths = np.full(64, 1000, dtype=np.int64)
    model = fm.LLAMA31_8B

    def transient(pp: int, m: int, **kw) -> float:
        return memory.pass_bytes(
            lengths, 0.0, model, Shape(pp=pp, micro_batches=m), train=True, **kw
        ).transient

    assert transient(1, 8) < 0.2 * transient(1, 1)  # gradient accumulation: one micro-batch at a time
    assert transient(2, 8) > 0.5 * transient(2, 1)  # GPipe: every micro-batch's layers (logits one at a time)
    assert transient(2, 8, one_f_one_b=True) < 0.4 * transient(2, 8)  # 1F1B: pp of them
    # gradient checkpointing keeps each layer's bf16 input, and one layer's activations while recomputed
    kept = 64 * 1000 * model.hidden * (model.layers * (memory.ACTIVATION_BYTES - 2) - memory.ACTIVATION_BYTES)
    assert transient(1, 1) - transient(1, 1, recompute=True) == pytest.approx(kept)


def test_sharding_spreads_the_whole_train_state_over_the_replicas() -> None:
    model, shape = fm.LLAMA31_8B, Shape(dp=8)
    zero1 = memory.state_bytes(model, shape, trains=True, sharded=False)  # (persistent, gradients)
    full = memory.state_bytes(model, shape, trains=True, sharded=True)
    assert zero1 == pytest.approx((model.params * (2 + 12 / 8), model.params * 2))
    assert full == pytest.approx((model.params * 14 / 8, model.params * 2 / 8))
    assert memory.state_bytes(model, shape, trains=False, sharded=False) == pytest.approx(
        (2 * model.params, 0)
    )
