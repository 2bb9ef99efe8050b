"""nereus_core.model.hf_dir: tiny random Hugging Face directories (written here, never downloaded) read
into Nereus's model, single device and tp=2, against transformers' own forward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nereus_core.config import ModelConfig, RopeScaling
from nereus_core.model import LlamaStage, vocab_parallel_logprobs
from nereus_core.model.hf_dir import HFDirError, read_hf_config, read_slices, read_stage_shards
from nereus_core.model.weights import param_shapes, shard_slices, shard_tensor
from tests.support.dist_utils import run_world
from tests.support.hf_models import LLAMA3_ROPE, SIZES, write_model

BATCH, SEQ = 2, 12


def _write(kind: str, root: Path) -> tuple[Path, Any]:
    """A tiny random model of ``kind`` saved under ``root``: Qwen2 (tied, sharded) or Llama (llama3 rope)."""
    return root / kind, write_model(kind, root / kind, shard="20KB" if kind == "qwen2" else None)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: _write(kind, root) for kind in ("qwen2", "llama")}


def _ids() -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _positions() -> torch.Tensor:
    return torch.arange(SEQ) + 40  # past Llama 3's original context (32): every RoPE band is exercised


def _hf_logprobs(model: Any) -> torch.Tensor:
    ids, positions = _ids(), _positions()
    with torch.no_grad():
        logits = model(ids, position_ids=positions[None].expand(BATCH, -1)).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _nereus_logprobs(stage: LlamaStage, group: Any = None) -> torch.Tensor:
    ids = _ids()
    with torch.no_grad():
        logits = stage(ids, _positions())
    return vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], group, tp_rank=stage.tp_rank)


def test_read_hf_config_takes_every_field_from_config_json(written: dict[str, tuple[Path, Any]]) -> None:
    qwen = read_hf_config(written["qwen2"][0])
    assert qwen == ModelConfig(
        **SIZES,
        architecture="Qwen2ForCausalLM",
        attention_bias=True,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    llama = read_hf_config(written["llama"][0])
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    assert llama == ModelConfig(
        **SIZES, rope_theta=500000.0, rope_scaling=RopeScaling(**scaling), rms_norm_eps=1e-5
    )
    # The older format (top-level rope_theta, rope_scaling with "type") reads the same.
    raw = json.loads((written["llama"][0] / "config.json").read_text())
    assert raw.pop("rope_parameters")["rope_type"] == "llama3"
    old = {**raw, "rope_theta": 500000.0, "rope_scaling": {**scaling, "type": "llama3"}}
    (written["llama"][0].parent / "old").mkdir()
    (written["llama"][0].parent / "old" / "config.json").write_text(json.dumps(old))
    assert read_hf_config(written["llama"][0].parent / "old") == llama


def test_qwen2_directory_is_sharded_and_tied(written: dict[str, tuple[Path, Any]]) -> None:
    path = written["qwen2"][0]
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    assert "lm_head.weight" not in weight_map
    assert "model.layers.0.self_attn.q_proj.bias" in weight_map


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_single_device_logprobs_equal_transformers(kind: str, written: dict[str, tuple[Path, Any]]) -> None:
    path, model = written[kind]
    config = read_hf_config(path)
    full = read_slices(path, dict.fromkeys(param_shapes(config)))
    stage = LlamaStage(config, layers=range(config.num_hidden_layers), first=True, last=True)
    stage.load_full_state(full)
    ours, ref = _nereus_logprobs(stage), _hf_logprobs(model)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert (ref - ref.mean()).abs().max() > 0.1  # random weights: the log-probs are not all alike


def _tp_rank_logprobs(rank: int, world: int, path: str) -> dict[str, Any]:
    config = read_hf_config(path)
    layers = range(config.num_hidden_layers)
    local = read_stage_shards(path, config, layers=layers, first=True, last=True, tp_rank=rank, tp=world)
    group = dist.group.WORLD
    stage = LlamaStage(
        config, layers=layers, first=True, last=True, tp_rank=rank, tp_size=world, tp_group=group
    )
    stage.load_local_state(local)
    return {"logprobs": _nereus_logprobs(stage, group), "local": local}


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_tp2_each_rank_reads_its_shards_and_matches_transformers(
    kind: str, written: dict[str, tuple[Path, Any]]
) -> None:
    path, model = written[kind]
    ref, state = _hf_logprobs(model), model.state_dict()
    for rank, result in enumerate(run_world(2, _tp_rank_logprobs, str(path))):
        torch.testing.assert_close(result["logprobs"], ref, atol=1e-5, rtol=0)
        for name, shard in result["local"].items():
            assert torch.equal(shard, shard_tensor(state[name], name, rank, 2)), name
        q_bias = result["local"].get("model.layers.1.self_attn.q_proj.bias")
        assert (q_bias is not None) == (kind == "qwen2")
        if q_bias is not None:
            assert q_bias.shape == (SIZES["hidden_size"] // 2,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_equal_the_full_tensors_slices_bitwise(
    dtype: torch.dtype, written: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    path, model = written["qwen2"]
    if dtype != torch.float32:
        path = tmp_path / "bf16"
        model.to(dtype).save_pretrained(path, max_shard_size="10KB")
        model.to(torch.float32)
    state = {name: t.to(dtype) for name, t in model.state_dict().items()}
    wanted = {
        "model.embed_tokens.weight": (slice(64, 128), slice(None)),
        "model.layers.0.self_attn.k_proj.bias": (slice(8, 16),),
        "model.layers.1.mlp.down_proj.weight": (slice(None), slice(32, 64)),
        "model.layers.1.self_attn.o_proj.weight": (slice(3, 17), slice(5, 6)),
        "model.norm.weight": None,
    }
    read = read_slices(path, wanted)
    assert list(read) == list(wanted)
    for name, index in wanted.items():
        expected = state[name] if index is None else state[name][index]
        assert read[name].dtype == dtype and torch.equal(read[name], expected), name
    name = "model.layers.0.self_attn.q_proj.weight"
    index = shard_slices(name, tuple(state[name].shape), 1, 2)
    assert torch.equal(
        read_slices(path, {name: index})[name], shard_tensor(state[name], name, 1, 2).to(dtype)
    )


def _one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unsupported_architecture_is_refused_in_one_line(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(HFDirError) as err:
        read_hf_config(tmp_path)
    message = _one_line(err)
    assert "GPT2LMHeadModel" in message and "supported: LlamaForCausalLM, Qwen2ForCausalLM" in message


def test_bad_directories_are_refused_in_one_line(
    tmp_path: Path, written: dict[str, tuple[Path, Any]]
) -> None:
    with pytest.raises(HFDirError, match="not found") as err:
        read_hf_config(tmp_path / "absent")
    _one_line(err)
    with pytest.raises(HFDirError, match=r"config\.json not found") as err:
        read_hf_config(tmp_path)
    _one_line(err)
    raw = json.loads((written["llama"][0] / "config.json").read_text())
    for change, expected in [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "o_proj bias"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn'"),
        ({"num_attention_heads": 5}, "num_attention_heads"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(HFDirError, match=expected) as err:
            read_hf_config(tmp_path)
        _one_line(err)
    with pytest.raises(HFDirError, match=r"neither model\.safetensors") as err:
        read_slices(tmp_path, {"model.norm.weight": None})
    _one_line(err)
    with pytest.raises(HFDirError, match=r"lm_head\.weight") as err:
        read_slices(written["qwen2"][0], {"lm_head.weight": None})
    _one_line(err)


def test_model_config_keeps_biases_to_qwen2() -> None:
    with pytest.raises(ValueError, match="q/k/v biases are Qwen2's"):
        ModelConfig(attention_bias=True)
    with pytest.raises(ValueError, match="q/k/v biases are Qwen2's"):
        ModelConfig(architecture="Qwen2ForCausalLM")
