"""A vLLM engine's KV cache in the memory model: preallocated per device (``rollout.kv_cache_memory_bytes``)
and held between steps, so it adds to whatever else its devices hold instead of taking turns with the
other stages' transient memory as Nereus's sampler's KV cache does."""

from __future__ import annotations

import copy
import re

import pytest

from flows.cli.plan_command import print_plan
from nereus_core.config import LLAMA_3_8B, Workload, engine_kv_bytes, parse_config
from nereus_core.config import rollout as rollout_config
from nereus_core.controller.search import Searcher, SearchSpace
from nereus_core.cost.hardware import H100_SXM
from nereus_core.cost.plan_estimate import memory_per_device
from nereus_core.cost.stage_cost import Scales, estimate
from nereus_core.layout import Layout
from nereus_core.plan import PPO_STAGES, GlobalPlan, models_for

GB = 1e9
MIB = 2**20
WORK = Workload(batch=1024, prompt_len=512, response_mean=2000, response_high=6000, response_max=8000)
JOB = {
    "name": "engine-memory",
    "cluster": {"devices": 2, "memory_per_device": "512MiB"},
    "model": {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2},
    "job": {"steps": 1, "batch_size": 4, "prompt_len": 4, "response_len": 4},
}


def _config(rollout: dict | None = None):
    data = copy.deepcopy(JOB)
    if rollout is not None:
        data["rollout"] = rollout
    return parse_config(data)


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config accepts ``engine: vllm`` (nothing here starts an engine)."""
    monkeypatch.setattr(rollout_config, "vllm_installed", lambda: True)


@pytest.mark.usefixtures("installed")
def test_the_engine_s_kv_bytes_come_from_the_rollout_section() -> None:
    assert engine_kv_bytes(_config()) == 0  # Nereus's sampler: sized by the batch, not preallocated
    vllm = _config({"engine": "vllm", "kv_cache_memory_bytes": "48MiB"})
    assert engine_kv_bytes(vllm) == 48 * MIB == Workload.from_config(vllm).engine_kv_bytes
    share = _config({"engine": "vllm", "kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.25})
    assert engine_kv_bytes(share) == 128 * MIB  # vLLM's share of the device, an upper bound


def test_the_engine_cache_is_persistent_and_fixed_the_sampler_s_is_transient_and_grows() -> None:
    layout = Layout.contiguous(tp=2)
    short, long = WORK.model_copy(update={"response_high": 2000}), WORK
    sampler = [estimate("actor/generate", layout, w, LLAMA_3_8B, H100_SXM).memory for w in (short, long)]
    assert sampler[0].engine_cache == 0 and 0 < sampler[0].kv_cache < sampler[1].kv_cache
    assert sampler[1].persistent == sampler[1].weights  # the KV cache is not held between steps
    kv = int(20 * GB)
    engine = [
        estimate("actor/generate", layout, w.model_copy(update={"engine_kv_bytes": kv}), LLAMA_3_8B, H100_SXM)
        for w in (short, long)
    ]
    for e in engine:
        assert e.memory.kv_cache == 0 and e.memory.engine_cache == kv
        assert e.memory.persistent == e.memory.weights + kv
    assert engine[0].memory == engine[1].memory  # preallocated: the response length does not move it
    train = estimate("actor/train", layout, WORK, LLAMA_3_8B, H100_SXM).memory
    plan = GlobalPlan.of({"actor/generate": layout, "actor/train": layout})
    with_sampler = memory_per_device(plan, {"actor/generate": sampler[1], "actor/train": train})[0]
    with_engine = memory_per_device(plan, {"actor/generate": engine[1].memory, "actor/train": train})[0]
    # the sampler's KV takes turns with training's gradients and activations; the engine's adds to them
    assert with_sampler == sampler[1].weights + train.persistent + max(sampler[1].transient, train.transient)
    assert with_engine == engine[1].memory.persistent + train.persistent + max(
        engine[1].memory.transient, train.transient
    )


def _feasible(engine_kv: int, *, colocated_only: bool = False) -> list:
    work = WORK.model_copy(update={"engine_kv_bytes": engine_kv})
    pools = {"disaggregated": False, "phased": False} if colocated_only else {}
    space = SearchSpace(devices=64, budget=72 * GB, pipelined_generation=False, **pools)
    found = Searcher(space, work, models_for(LLAMA_3_8B), H100_SXM, Scales(), stages=PPO_STAGES).run()
    return found.feasible


def test_an_engine_cache_that_leaves_no_room_for_training_moves_generation_off_its_devices() -> None:
    def shares_devices(plan: GlobalPlan) -> bool:
        gen = set(plan.layouts["actor/generate"].devices)
        return any(gen & set(v.devices) for s, v in plan.layouts.items() if s != "actor/generate")

    # a small cache: colocated plans fit (searched alone: other splits may be faster and win)
    assert any(shares_devices(f.plan) for f in _feasible(int(1 * GB), colocated_only=True))
    # 60 GB of 72 held all the job: no colocated plan fits, even recomputing, under 1F1B and with the
    # train state sharded over dp (at 56 GB a colocated plan sharding over 64 ranks still fits)
    assert not _feasible(int(60 * GB), colocated_only=True)
    big = _feasible(int(60 * GB))
    assert big, "generation on its own devices should still fit"
    assert not any(shares_devices(f.plan) for f in big)


@pytest.mark.usefixtures("installed")
def test_nereus_plan_weighs_a_vllm_job_as_its_controller_does(capsys: pytest.CaptureFixture[str]) -> None:
    """No pipelined generation among the plans it shows, and generation's GiB/slot holds the cache."""
    cfg = _config({"engine": "vllm", "kv_cache_memory_bytes": "200MiB"})
    assert print_plan(cfg, profile="cpu") == 0
    out = capsys.readouterr().out
    assert "actor/generate" in out and not re.search(r"actor/generate tp\d+\.pp[2-9]", out), out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("actor/generate"))
    assert float(row[-1]) >= 200 / 1024  # GiB on each of generation's slots: at least the engine's cache
