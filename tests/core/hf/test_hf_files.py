"""nereus_core/hf/files.py at config load (``model.path``, ``critic.path``, ``reward.model_path``,
``model.tokenizer``: the directory decides, a conflict or a bad directory is one line), and a value-head
directory read into Nereus's model against transformers' token classifier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nereus_core.config import ConfigError, parse_config
from nereus_core.engine.hf_load import HFDirStore, HFSource, fresh_value_head, hf_source
from nereus_core.model import LlamaStage
from nereus_core.model.hf_dir import read_hf_config, read_slices, read_value_config
from nereus_core.model.weights import SCORE, param_shapes
from nereus_core.plan import ModelStage
from tests.support.data_files import TOKENIZER, files
from tests.support.hf_models import SIZES, randomize, write_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    write_model("qwen2", root / "qwen2", shard="20KB")
    write_model("llama", root / "llama")
    return {"qwen2": root / "qwen2", "llama": root / "llama", "root": root}


def _value_dir(
    root: Path, kind: str, *, labels: int = 1, bias: float = 0.0, **changes: Any
) -> tuple[Path, Any]:
    """A random Llama sequence- or token-classification directory (``kind``: Sequence or Token)."""
    import transformers
    from transformers import LlamaConfig

    from tests.support.hf_models import LLAMA3_ROPE

    config = LlamaConfig(
        **{**SIZES, **changes}, rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5, num_labels=labels
    )
    cls = getattr(transformers, f"LlamaFor{kind}Classification")
    model = randomize(cls._from_config(config, attn_implementation="eager"), seed=11)
    if getattr(model.score, "bias", None) is not None:
        with torch.no_grad():
            model.score.bias.fill_(bias)
    path = root / "-".join([kind, str(labels), str(bias), *(f"{k}{v}" for k, v in sorted(changes.items()))])
    model.save_pretrained(path)
    return path, model


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_model_path_decides_the_shapes(dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(dirs["root"])
    cfg = parse_config({"model": {"path": "qwen2", "seed": 3}})  # relative to where the job starts
    assert cfg.model.path == str(dirs["qwen2"])
    imported = read_hf_config(dirs["qwen2"])
    assert cfg.model.model_copy(update={"path": None, "seed": 0}) == imported
    assert cfg.model.architecture == "Qwen2ForCausalLM" and cfg.model.tie_word_embeddings
    # Fields beside path that equal the directory's are fine, in any spelling YAML gives them.
    same = {"path": "qwen2", "hidden_size": 32, "rms_norm_eps": 0.000001, "rope_theta": 1000000}
    assert parse_config({"model": same}).model == cfg.model.model_copy(update={"seed": 0})
    # What a run directory stores reads back the same (resume, export).
    assert parse_config(cfg.model_dump(mode="json")) == cfg
    assert cfg.model.tokenizer_dir == cfg.model.path


def test_a_field_beside_path_that_differs_is_refused(dirs: dict[str, Path]) -> None:
    path = str(dirs["llama"])
    message = _error({"model": {"path": path, "hidden_size": 64}})
    assert message.startswith("model.hidden_size=64 conflicts with 32 in ") and "config.json" in message
    assert "remove model.hidden_size" in message
    message = _error({"model": {"path": path, "tie_word_embeddings": True}})
    assert "model.tie_word_embeddings=True conflicts with False" in message
    message = _error({"model": {"path": path, "rope_scaling": None}})
    assert "model.rope_scaling=None conflicts with" in message
    assert "did you mean hidden_size" in _error({"model": {"path": path, "hiden_size": 32}})
    assert "model.num_hidden_layers" in _error({"model": {"path": path, "num_hidden_layers": "two"}})


def test_bad_model_directories_are_one_line_at_config_load(dirs: dict[str, Path], tmp_path: Path) -> None:
    from transformers import GPT2Config

    assert _error({"model": {"path": str(tmp_path / "absent")}}).startswith("model.path: model directory ")
    assert "config.json not found" in _error({"model": {"path": str(tmp_path)}})
    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    message = _error({"model": {"path": str(tmp_path)}})
    assert "GPT2LMHeadModel is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM" in message
    # tp must divide the imported heads: kv heads 2, tp 4.
    plan = {"actor/train": {"tp": 4, "devices": [0, 1, 2, 3]}}
    message = _error({"cluster": {"devices": 4}, "model": {"path": str(dirs["llama"])}, "plan": plan})
    assert (
        "tp=4 does not divide model.num_key_value_heads=2 (from " in message and "valid tp: [1, 2]" in message
    )
    # pp with tied embeddings (Qwen2's) is refused as for a seeded model.
    plan = {"actor/train": {"pp": 2, "devices": [0, 1]}}
    assert "tie_word_embeddings" in _error({"model": {"path": str(dirs["qwen2"])}, "plan": plan})
    message = _error({"model": {"path": str(dirs["llama"]), "tokenizer": str(dirs["llama"])}})
    assert message.startswith("model.tokenizer: ") and "has no tokenizer files" in message


def test_critic_path_takes_a_one_label_classifier_of_its_own_shapes_and_the_actors_vocabulary(
    dirs: dict[str, Path],
) -> None:
    root, llama = dirs["root"], str(dirs["llama"])
    for kind in ("Sequence", "Token"):
        path, _ = _value_dir(root, kind)
        cfg = parse_config({"model": {"path": llama}, "critic": {"path": str(path)}})
        assert hf_source(cfg, "critic") == HFSource(str(path))
        assert hf_source(cfg, "actor") == hf_source(cfg, "reference") == HFSource(llama)
    wider, _ = _value_dir(root, "Sequence", hidden_size=64, num_hidden_layers=3)
    models = parse_config({"model": {"path": llama}, "critic": {"path": str(wider)}}).models
    assert (models["critic"].hidden_size, models["critic"].num_hidden_layers) == (64, 3)
    assert (
        models["critic"].head == "value" and models["actor"].hidden_size == models["reward"].hidden_size == 32
    )
    assert hf_source(parse_config({"model": {"path": llama}}), "critic") == HFSource(llama, fresh_head=True)
    assert hf_source(parse_config({"model": {"path": llama}}), "reward") is None
    assert hf_source(parse_config({}), "actor") is None
    bad = [
        (_value_dir(root, "Sequence", labels=2)[0], "2 labels; a value head has one"),
        (_value_dir(root, "Token", bias=0.5)[0], "score.bias is [0.5], not zero"),
        (
            _value_dir(root, "Sequence", vocab_size=64)[0],
            "vocab_size=64 differs from the actor's 128; the critic reads the actor's token ids",
        ),
        (_value_dir(root, "Sequence", max_position_embeddings=8)[0], "max_position_embeddings=8 is shorter"),
        (dirs["llama"], "LlamaForCausalLM is not supported; supported: LlamaForSequenceClassification"),
    ]
    for path, needle in bad:
        message = _error({"model": {"path": llama}, "critic": {"path": str(path)}})
        assert message.startswith("critic.path: ") and needle in message, message
    # A plan's degrees are checked against the critic's own heads, and the refusal names them as the
    # critic's (its directory), not as the job's model: section.
    own, _ = _value_dir(root, "Token", hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    plan = {"critic/train": {"tp": 2, "devices": [0, 1]}}
    message = _error(
        {"cluster": {"devices": 2}, "model": {"path": llama}, "critic": {"path": str(own)}, "plan": plan}
    )
    assert "critic/train: tp=2 does not divide the critic model's num_key_value_heads=3; valid tp" in message
    assert "model.num_key_value_heads" not in message


def test_reward_model_path_takes_a_one_label_classifier_of_the_actors_vocabulary(
    dirs: dict[str, Path], tmp_path: Path
) -> None:
    root, llama = dirs["root"], str(dirs["llama"])
    train, _ = files(tmp_path)
    data = {"train_files": [train], "max_prompt_length": 64, "max_response_length": 16}

    def job(reward: dict[str, Any], **more: Any) -> dict[str, Any]:
        model = {"path": llama, "tokenizer": TOKENIZER}
        return {"model": model, "data": data, "reward": {"function": "gsm8k", **reward}, **more}

    path, _ = _value_dir(root, "Sequence")
    cfg = parse_config(job({"model_path": str(path)}))
    assert hf_source(cfg, "reward") == HFSource(str(path)) and cfg.uses_reward_model
    assert ModelStage.REWARD_INFER in cfg.stages  # the reward model scores; the rule is only logged
    assert ModelStage.REWARD_INFER not in parse_config(job({})).stages
    bad = [
        (_value_dir(root, "Sequence", labels=2)[0], "2 labels; a value head has one"),
        (
            _value_dir(root, "Sequence", vocab_size=64)[0],
            "vocab_size=64 differs from the actor's 128; the reward model reads the actor's token ids",
        ),
        (dirs["llama"], "LlamaForCausalLM is not supported; supported: LlamaForSequenceClassification"),
        (tmp_path, "config.json not found"),
    ]
    for where, needle in bad:
        message = _error(job({"model_path": str(where)}))
        assert message.startswith("reward.model_path: ") and needle in message, message
    grpo = {"algorithm": {"name": "grpo", "group_size": 2}, "job": {"batch_size": 4}}
    message = _error(job({"model_path": str(path)}, **grpo))
    assert "algorithm grpo scores with reward.function only" in message, message


def test_a_token_classifiers_values_equal_transformers(dirs: dict[str, Path]) -> None:
    path, model = _value_dir(dirs["root"], "Token")
    config = read_value_config(path)
    assert config.head == "value" and config.architecture == "LlamaForCausalLM"
    full = read_slices(path, dict.fromkeys(param_shapes(config)))
    stage = LlamaStage(config, layers=range(config.num_hidden_layers), first=True, last=True)
    stage.load_full_state(full)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = stage(ids, torch.arange(9))
        ref = model(ids).logits[..., 0]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert ref.std() > 0.01


def test_the_store_reads_boxes_and_draws_the_fresh_head(dirs: dict[str, Path]) -> None:
    from nereus_core.emu import Box, state_name

    path, _ = _value_dir(dirs["root"], "Sequence")
    config = read_value_config(path)
    name = "model.layers.1.mlp.down_proj.weight"
    box, step_box = Box((0, 16), (32, 48)), Box((), ())
    moment = state_name(name, "exp_avg")
    store = HFDirStore(HFSource(str(path)), config)
    got = store.read_pieces(
        [(name, box), (SCORE, Box((0, 0), (1, 32))), (moment, box), ("optimizer:step", step_box)]
    )
    full = read_slices(path, {name: None, SCORE: None})
    assert torch.equal(got[0], full[name][:, 16:48]) and torch.equal(got[1], full[SCORE])
    assert not got[2].any() and got[2].shape == (32, 32) and got[3].shape == () and got[3].item() == 0
    assert store.file_bytes == (32 * 32 + 32) * 4
    fresh = HFDirStore(HFSource(str(dirs["llama"]), fresh_head=True), config)
    head = fresh.read_pieces([(SCORE, Box((0, 0), (1, 32)))])[0]
    assert torch.equal(head, fresh_value_head(config)) and fresh.file_bytes == 0
    assert torch.equal(fresh_value_head(config), fresh_value_head(config))  # every device draws the same
    assert not torch.equal(head, full[SCORE])
    with pytest.raises(TypeError, match="nothing is written"):
        store.write_pieces(0, [])
