"""A bf16 Hugging Face directory imported with ``model.dtype: bf16``: the stages hold the file's bf16
values (no widening, no rounding), the step-0 checkpoint keeps them, and ``nereus export`` gives back
every tensor bitwise in bf16."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nereus_core import job
from nereus_core.config import parse_config
from storage.export import export_hf
from storage.run_dir import RunDir
from tasks import job_ops, model_ops
from tasks.runtime.device_pool import DevicePool
from tests.support.hf_models import SIZES, assert_same_tensors, directory_tensors, write_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pool() -> Iterator[DevicePool]:
    with DevicePool(2, failure_grace_s=10.0) as pool:
        yield pool


@pytest.mark.slow  # about 40 s; bf16 with fp32 masters moves bitwise by default in test_transition_bf16.py
def test_bf16_directory_imports_and_exports_bitwise_in_bf16(pool: DevicePool, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = write_model("llama", tmp_path / "scratch")
    path = tmp_path / "llama-bf16"
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="10KB")
    tp2 = {"tp": 2, "pp": 1, "dp": 1, "devices": [0, 1]}
    plan = {stage: tp2 for stage in ("actor/train", "actor/generate", "critic/train", "critic/infer")}
    plan |= {"reference/infer": {"tp": 1, "pp": 2, "dp": 1, "devices": [0, 1], "micro_batches": 2}}
    cfg = parse_config({"model": {"path": str(path), "dtype": "bf16"}, "plan": plan})
    state = job.start(cfg)
    job_ops.load_models(pool, cfg, state.layouts, state.aliased, reward_state=None)
    ids = torch.randint(0, SIZES["vocab_size"], (4, 10), generator=torch.Generator().manual_seed(3))
    try:
        run = RunDir.create(tmp_path / "run", cfg.model_dump(mode="json"))
        job_ops.checkpoint.fn(pool, str(run.root), state, 0, digests=False)
        got = {
            s: model_ops.forward(pool, state.layouts[s], ids, name=s)
            for s in ("actor/train", "reference/infer")
        }
    finally:
        for stage, layout in state.layouts.items():
            model_ops.unload_model(pool, layout, name=stage)

    original = directory_tensors(path)
    assert all(tensor.dtype == torch.bfloat16 for tensor in original.values())
    out = export_hf(run.root, model="actor", step=0, out=tmp_path / "actor")
    assert_same_tensors(load_file(out / "model.safetensors"), original)  # bf16 as well, then

    # Outputs of the bf16 stages against transformers' bf16 model (bf16 arithmetic: a loose bound).
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(ids).logits.float()
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    for stage, logp in got.items():
        torch.testing.assert_close(logp.float(), expected, atol=5e-2, rtol=0, msg=stage)
