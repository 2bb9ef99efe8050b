"""Importing a Hugging Face directory onto a 2-device Dask pool (tasks/model_ops.py ``import_model``,
tasks/job_ops.py ``load_models``): each device reads only its own slices, the shards equal the
directory's tensors bitwise, the outputs equal transformers', and ``nereus export`` of the imported
model at step 0 gives back every tensor bitwise in a directory transformers loads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from nereus_core import job
from nereus_core.config import ModelConfig, parse_config
from nereus_core.engine.hf_load import HFSource, fresh_value_head
from nereus_core.engine.shard import shard_state
from nereus_core.hf.tokenizer import chat_prompt_ids, load_tokenizer, stop_token_ids
from nereus_core.layout import Layout
from nereus_core.model.hf_dir import read_hf_config
from nereus_core.model.weights import param_shapes, shard_tensor, stage_layers, stage_param_names
from storage.export import export_hf
from storage.run_dir import RunDir
from tasks import job_ops, model_ops
from tasks.runtime.device_pool import DevicePool
from tests.support.hf_models import (
    SIZES,
    assert_same_tensors,
    directory_tensors,
    write_model,
    write_tokenizer,
)

pytestmark = pytest.mark.timeout(300)
NAME = "reference/infer"
CHAT = [[{"role": "user", "content": "How many eggs?"}]]


@pytest.fixture(scope="module")
def pool() -> Iterator[DevicePool]:
    with DevicePool(2, failure_grace_s=10.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Qwen2 with tied embeddings and Llama, both saved in several safetensors files; Qwen2's with a
    tokenizer and a generation config beside the weights."""
    from transformers import GenerationConfig

    root = tmp_path_factory.mktemp("hf")
    out = {kind: (root / kind, write_model(kind, root / kind, shard="20KB")) for kind in ("qwen2", "llama")}
    model = write_model("llama", root / "scratch")
    model.to(torch.bfloat16).save_pretrained(root / "llama-bf16", max_shard_size="10KB")
    out["llama-bf16"] = (root / "llama-bf16", model.float())  # the bf16 values, computed in fp32 as ours
    write_tokenizer(root / "qwen2")
    GenerationConfig(eos_token_id=[4, 0]).save_pretrained(root / "qwen2")
    return out


def _ids() -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (4, 10), generator=torch.Generator().manual_seed(3))


def _hf_logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _layout(tp: int, pp: int) -> Layout:
    return Layout.contiguous(tp=tp, pp=pp, micro_batches=pp)


@pytest.mark.parametrize(
    ("kind", "tp", "pp"), [("qwen2", 2, 1), ("llama", 2, 1), ("llama", 1, 2), ("llama-bf16", 2, 1)]
)
def test_each_device_reads_only_its_shards(
    pool: DevicePool, written: dict[str, tuple[Path, Any]], kind: str, tp: int, pp: int
) -> None:
    path, model = written[kind]
    config, layout = read_hf_config(path), _layout(tp, pp)
    file_dtype = torch.bfloat16 if kind.endswith("bf16") else torch.float32
    figures = model_ops.import_model(pool, layout, name=NAME, config=config, source=HFSource(str(path)))
    try:
        state, shapes = model.state_dict(), param_shapes(config)
        shards = pool.run_on(layout.devices, shard_state, name=NAME)
        for device, (local, fig) in enumerate(zip(shards, figures, strict=True)):
            coord = layout.coord_of_device(device)
            names = stage_param_names(
                config,
                stage_layers(config, layout, coord.pp),
                coord.pp == 0,
                coord.pp == pp - 1,
            )
            assert sorted(local) == sorted(names)
            for name in names:  # held in fp32; a bf16 file's values widened exactly
                expected = shard_tensor(state[name], name, coord.tp, tp).to(file_dtype).float()
                assert local[name].dtype == torch.float32 and torch.equal(local[name], expected), name
            # Exactly its shards' bytes came out of the files: about half of the model, never all of it.
            mine = sum(t.numel() * file_dtype.itemsize for t in local.values())
            assert fig["file_bytes"] == mine
            whole = sum(4 * torch.Size(s).numel() for s in shapes.values())
            assert mine < 0.75 * whole
        ids = _ids()
        ours = model_ops.forward(pool, layout, ids, name=NAME)
        torch.testing.assert_close(ours, _hf_logprobs(model, ids), atol=1e-5, rtol=0)
    finally:
        model_ops.unload_model(pool, layout, name=NAME)


PLANS = {
    # qwen2 (tied: no pp): the generate copy loaded from the directory (dp2), the critic/infer copy aliased
    "qwen2": {
        "actor/train": {"tp": 2, "devices": [0, 1]},
        "actor/generate": {"dp": 2, "devices": [0, 1]},
        "critic/train": {"tp": 2, "devices": [0, 1]},
        "critic/infer": {"tp": 2, "devices": [0, 1]},
        "reference/infer": {"devices": [1]},
        "reward/infer": {"devices": [0]},
    },
    "llama": {
        "actor/train": {"pp": 2, "devices": [0, 1], "micro_batches": 2},
        "actor/generate": {"pp": 2, "devices": [0, 1], "micro_batches": 2},
        "critic/train": {"dp": 2, "devices": [0, 1]},
        "critic/infer": {"tp": 2, "devices": [0, 1]},
        "reference/infer": {"tp": 2, "devices": [0, 1]},
        "reward/infer": {"devices": [1]},
    },
}


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_job_loads_from_model_path_and_exports_it_bitwise_at_step_0(
    pool: DevicePool, written: dict[str, tuple[Path, Any]], kind: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    path, model = written[kind]
    cfg = parse_config({"model": {"path": str(path), "seed": 5}, "plan": PLANS[kind]})
    state = job.start(cfg)
    job_ops.load_models(pool, cfg, state.layouts, state.aliased, reward_state=None)
    try:
        run = RunDir.create(tmp_path / "run", cfg.model_dump(mode="json"))
        job_ops.checkpoint.fn(pool, str(run.root), state, 0, digests=False)
        ids = _ids()
        expected = _hf_logprobs(model, ids)
        for stage in ("actor/train", "actor/generate", "reference/infer"):
            got = model_ops.forward(pool, state.layouts[stage], ids, name=stage)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=stage)
        # The critic's inference copy (loaded on its own in llama's plan) draws the same fresh head.
        values = {
            s: model_ops.forward(pool, state.layouts[s], ids, name=s)
            for s in ("critic/train", "critic/infer")
        }
        torch.testing.assert_close(values["critic/infer"], values["critic/train"], atol=1e-5, rtol=0)
        assert values["critic/train"].shape == ids.shape and values["critic/train"].std() > 0
    finally:
        for stage, layout in state.layouts.items():
            model_ops.unload_model(pool, layout, name=stage)

    # The actor exported at step 0: the directory's tensors, every one, bitwise, under the same names.
    original = directory_tensors(path)
    out = export_hf(run.root, model="actor", step=0, out=tmp_path / "actor")
    assert_same_tensors(load_file(out / "model.safetensors"), original)
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back).__name__ == type(model).__name__
    torch.testing.assert_close(_hf_logprobs(back, ids), expected, atol=0, rtol=0)

    # Its tokenizer and generation config go along (a directory as complete as the one it came from).
    if kind == "qwen2":
        tokenizer = load_tokenizer(out)
        assert chat_prompt_ids(tokenizer, CHAT) == chat_prompt_ids(load_tokenizer(path), CHAT)
        assert stop_token_ids(tokenizer, out) == stop_token_ids(load_tokenizer(path), path) == (4, 0)
    else:
        assert not list(out.glob("tokenizer*"))  # none to take
    assert (out / "generation_config.json").read_text() == (path / "generation_config.json").read_text()

    # The critic: the actor's backbone and the fresh value head (verl's init), a sequence classifier.
    out = export_hf(run.root, model="critic", step=0, out=tmp_path / "critic")
    critic = load_file(out / "model.safetensors")
    value = ModelConfig(**{**cfg.model.model_dump(), "head": "value"})
    assert torch.equal(critic["score.weight"], fresh_value_head(value))
    assert critic["score.weight"].std().item() == pytest.approx(cfg.model.init_std, rel=0.5)
    for name in critic:
        if name != "score.weight":
            assert torch.equal(critic[name], original[name]), name
    loaded = AutoModelForSequenceClassification.from_pretrained(out)
    assert torch.equal(loaded.score.weight.detach(), critic["score.weight"])
