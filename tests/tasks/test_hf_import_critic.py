"""A critic read from its own directory (``critic.path``) with shapes of its own: a one-label Llama
token classifier wider and deeper than the actor, sharing only its vocabulary. On a 2-device pool its
train (dp2) and inference (pp2) stages give transformers' per-token values, and ``nereus export`` at
step 0 gives back every tensor of the directory bitwise."""

from __future__ import annotations

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
from tests.support.hf_models import LLAMA3_ROPE, SIZES, randomize, write_model

pytestmark = pytest.mark.timeout(300)
WIDER = {**SIZES, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3}
WIDER |= {"num_attention_heads": 6, "num_key_value_heads": 3}
PLAN = {
    "actor/train": {"dp": 2, "devices": [0, 1]},
    "actor/generate": {"tp": 2, "devices": [0, 1]},
    "critic/train": {"dp": 2, "devices": [0, 1]},
    "critic/infer": {"pp": 2, "devices": [0, 1], "micro_batches": 2},  # tp2 does not divide 3 kv heads
    "reference/infer": {"devices": [0]},
    "reward/infer": {"devices": [1]},
}


def _write_critic(path: Path) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForTokenClassification

    config = LlamaConfig(**WIDER, rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5, num_labels=1)
    model = randomize(LlamaForTokenClassification._from_config(config, attn_implementation="eager"), seed=13)
    with torch.no_grad():
        model.score.bias.zero_()  # Nereus's value head has no bias; a zero one is accepted
    model.save_pretrained(path)
    return model


def test_a_critic_of_its_own_shapes_loads_computes_and_exports_as_its_directory(tmp_path: Path) -> None:
    write_model("llama", tmp_path / "actor")
    critic = _write_critic(tmp_path / "critic")
    cfg = parse_config(
        {
            "model": {"path": str(tmp_path / "actor")},
            "critic": {"path": str(tmp_path / "critic")},
            "plan": PLAN,
        }
    )
    assert cfg.models["critic"].hidden_size == 48 and cfg.models["actor"].hidden_size == SIZES["hidden_size"]
    ids = torch.randint(0, SIZES["vocab_size"], (4, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = critic(ids).logits[..., 0]
    state = job.start(cfg)
    with DevicePool(2, failure_grace_s=10.0) as pool:
        job_ops.load_models(pool, cfg, state.layouts, state.aliased, reward_state=None)
        for stage in ("critic/train", "critic/infer"):
            got = model_ops.forward(pool, state.layouts[stage], ids, name=stage)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=stage)
        run = RunDir.create(tmp_path / "run", cfg.model_dump(mode="json"))
        job_ops.checkpoint.fn(pool, str(run.root), state, 0, digests=False)
    exported = load_file(
        export_hf(run.root, model="critic", step=0, out=tmp_path / "out") / "model.safetensors"
    )
    original = load_file(tmp_path / "critic" / "model.safetensors")
    original.pop("score.bias")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
