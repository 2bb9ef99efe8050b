"""nereus_core.cost.terms: generation's waves are rounds, each running until its own longest sequence."""

from __future__ import annotations

import pytest

from nereus_core.config import LLAMA_3_8B, Workload
from nereus_core.cost.hardware import H100_SXM
from nereus_core.cost.stage_cost import estimate
from nereus_core.layout import Layout


def test_each_generation_wave_runs_until_its_own_longest_sequence() -> None:
    """Waves are rounds: the second starts when the first's longest sequence ends, so it adds the
    high quantile's decode iterations (each reading the weights), not the mean's; the KV cache a
    wave holds halves. (The simulator's engine runs waves this way: ``stage_world.generation_s``.)"""
    w = Workload(batch=512, prompt_len=512, response_mean=1000, response_high=3000, response_max=5000)
    one, two = (
        estimate("actor/generate", Layout.contiguous(tp=2, dp=4, micro_batches=m), w, LLAMA_3_8B, H100_SXM)
        for m in (1, 2)
    )
    weight_read = 16.06e9 / 2 / H100_SXM.hbm  # Llama-3-8B bf16 weights over tp=2, per iteration
    assert two.raw["decode"] - one.raw["decode"] == pytest.approx(3000 * weight_read, rel=0.01)
    assert two.raw["compute"] == pytest.approx(one.raw["compute"])  # the same tokens generated
    assert two.memory.kv_cache == pytest.approx(one.memory.kv_cache / 2, rel=0.01)
