"""nereus_core.config: valid configs load; each bad one fails with one line that names the field."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus_core.config import (
    MODEL_STAGES,
    ConfigError,
    NereusConfig,
    name_error,
    parse_config,
    with_overrides,
)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny_ppo.yaml"


Edit = Callable[[dict[str, Any]], None]


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def example4() -> dict[str, Any]:
    """The demo as it runs after its devices grow to 4 (the bad-config table edits that)."""
    data = example()
    data["cluster"]["devices"] = 4
    data["plan"] = {
        "actor/generate": _layout(2, 1, 1, [0, 1]),
        "actor/train": _layout(2, 1, 2, [0, 1, 2, 3]),
        "critic/train": _layout(1, 2, 2, [0, 1, 2, 3], micro_batches=2),
        "critic/infer": _layout(1, 2, 2, [0, 1, 2, 3], micro_batches=2),
        "reference/infer": _layout(2, 1, 1, [2, 3]),
        "reward/infer": _layout(1, 1, 2, [2, 3]),
    }
    return data


def _layout(tp: int, pp: int, dp: int, devices: list[int], **extra: Any) -> dict[str, Any]:
    return {"tp": tp, "pp": pp, "dp": dp, "devices": devices, **extra}


def _set(path: str, value: Any) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    return edit


def _edits(*edits: Edit) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        for one in edits:
            one(data)

    return edit


def _rename_stage(old: str, new: str) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        data["plan"][new] = data["plan"].pop(old)

    return edit


# (id, edit of the example, the field the message must name, other substrings it must contain)
BAD: list[tuple[str, Edit, str, tuple[str, ...]]] = [
    (
        "tp-not-dividing-heads",
        _set("plan.actor/train", _layout(3, 1, 1, [0, 1, 2])),
        "plan.actor/train",
        ("tp=3 does not divide model.num_attention_heads=8", "valid tp"),
    ),
    (
        "tp-not-dividing-kv-heads",
        _edits(_set("cluster.devices", 8), _set("plan.actor/train", _layout(8, 1, 1, list(range(8))))),
        "plan.actor/train",
        ("tp=8 does not divide model.num_key_value_heads=4", "valid tp: [1, 2, 4]"),
    ),
    (
        "degrees-over-the-pool",
        _set("plan.actor/train", _layout(2, 2, 2, list(range(8)))),
        "plan.actor/train",
        ("tp*pp*dp=8 exceeds cluster.devices=4",),
    ),
    (
        "device-used-twice",
        _set("plan.reward/infer", _layout(1, 1, 2, [2, 2])),
        "plan.reward/infer",
        ("device 2 is used twice",),
    ),
    (
        "device-outside-the-pool",
        _set("plan.reward/infer", _layout(1, 1, 2, [2, 7])),
        "plan.reward/infer",
        ("device 7 is outside the pool", "0..3"),
    ),
    (
        "negative-device",
        _set("plan.reward/infer", _layout(1, 1, 2, [-1, 2])),
        "plan.reward/infer",
        ("device -1 is negative",),
    ),
    (
        "device-count-not-tp-pp-dp",
        _set("plan.reward/infer", _layout(1, 1, 2, [2])),
        "plan.reward/infer",
        ("tp*pp*dp=1*1*2=2", "list exactly 2"),
    ),
    (
        "pp-over-layers",
        _edits(_set("cluster.devices", 8), _set("plan.actor/train", _layout(1, 8, 1, list(range(8))))),
        "plan.actor/train",
        ("pp=8 exceeds model.num_hidden_layers=4",),
    ),
    (
        "hidden-not-divisible-by-heads",
        _set("model.hidden_size", 66),
        "model.hidden_size",
        ("model.hidden_size=66", "model.num_attention_heads=8"),
    ),
    (
        "heads-not-multiple-of-kv-heads",
        _set("model.num_key_value_heads", 3),
        "model.num_key_value_heads",
        ("model.num_attention_heads=8", "model.num_key_value_heads=3"),
    ),
    (
        "odd-head-dim",
        _set("model.hidden_size", 24),
        "model.hidden_size",
        ("model.hidden_size/model.num_attention_heads=3", "even head_dim"),
    ),
    (
        "unknown-field",
        _set("job.stepz", 3),
        "job.stepz",
        ("unknown field", "did you mean steps?", "valid fields: steps"),
    ),
    (
        "unknown-section",
        _set("optimizer", {"lr": 1}),
        "optimizer",
        ("unknown field", "valid fields: name, cluster, model, job, algorithm, ppo, trainer, plan"),
    ),
    (
        "unknown-layout-field",
        _set("plan.actor/train.tpp", 2),
        "plan.actor/train.tpp",
        ("unknown field", "did you mean tp?"),
    ),
    (
        "unknown-model-stage",
        _rename_stage("actor/train", "actor/trian"),
        "plan.actor/trian",
        (f"plan.actor/trian: unknown model-stage; valid: {', '.join(MODEL_STAGES)}",),
    ),
    ("zero-steps", _set("job.steps", 0), "job.steps", ("job.steps=0", "must be >= 1")),
    ("negative-steps", _set("job.steps", -3), "job.steps", ("job.steps=-3", "must be >= 1")),
    ("steps-not-a-number", _set("job.steps", "many"), "job.steps", ("'many'", "valid integer")),
    (
        "batch-not-divisible",
        _set("job.batch_size", 6),
        "job.batch_size",
        ("job.batch_size/ppo.mini_batches=3 is not divisible by dp*micro_batches=2", "plan.actor/train"),
    ),
    (
        "sequence-over-max-positions",
        _set("job.response_len", 253),
        "job.response_len",
        ("job.prompt_len+job.response_len=257", "model.max_position_embeddings=256"),
    ),
    (
        "memory-unparsable",
        _set("cluster.memory_per_device", "lots"),
        "cluster.memory_per_device",
        ("'lots'", "2GiB"),
    ),
    (
        "memory-zero",
        _set("cluster.memory_per_device", 0),
        "cluster.memory_per_device",
        ("cluster.memory_per_device=0", "must be > 0"),
    ),
    ("bad-backend", _set("cluster.backend", "mpi"), "cluster.backend", ("'mpi'", "'gloo'", "'nccl'")),
    ("dtype-fp16", _set("model.dtype", "fp16"), "model.dtype", ("fp16", "loss scaling", "bf16")),
    ("dtype-unknown", _set("model.dtype", "int8"), "model.dtype", ("'int8'", "'bf16'")),
    ("devices-not-a-list", _set("plan.actor/train.devices", "0,1"), "plan.actor/train.devices", ("list",)),
    (
        "device-not-an-int",
        _set("plan.actor/train.devices", [0, "a", 2, 3]),
        "plan.actor/train.devices[1]",
        ("'a'", "integer"),
    ),
    ("layout-not-a-mapping", _set("plan.actor/train", 3), "plan.actor/train", ("mapping",)),
    ("empty-section", _set("model", None), "model", ("is empty",)),
    ("missing-devices", _set("plan.actor/train", {"tp": 2}), "plan.actor/train.devices", ("missing",)),
    ("empty-name", _set("name", ""), "name", ("at least 1 character",)),
    (
        "tied-embeddings-with-pp",
        _edits(
            _set("model.tie_word_embeddings", True), _set("plan.actor/train", _layout(1, 2, 2, [0, 1, 2, 3]))
        ),
        "model.tie_word_embeddings",
        ("plan.actor/train", "pp>1"),
    ),
]


@pytest.mark.parametrize(("edit", "field", "needles"), [pytest.param(*row[1:], id=row[0]) for row in BAD])
def test_bad_config_has_one_line_naming_the_field(edit: Edit, field: str, needles: tuple[str, ...]) -> None:
    data = example4()
    edit(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    message = str(info.value)
    assert "\n" not in message, message
    assert "Traceback" not in message
    assert field in message, f"{message!r} does not name {field!r}"
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_bad_table_is_large_enough() -> None:
    assert len(BAD) >= 12
    assert len({row[0] for row in BAD}) == len(BAD)


def test_example_loads() -> None:
    cfg = parse_config(example())
    assert cfg.name == "tiny-ppo"
    assert cfg.cluster.devices == 2
    assert cfg.cluster.memory_per_device == 64 * 1024**2
    assert [(e.step, e.devices, e.response_len) for e in cfg.job.scenario] == [(10, 4, None), (25, None, 24)]
    assert cfg.job.response_lens() == (6, 24) and cfg.job.adapt
    assert (cfg.model.vocab_size, cfg.model.hidden_size, cfg.model.num_hidden_layers) == (32, 64, 4)
    assert (cfg.model.num_attention_heads, cfg.model.num_key_value_heads) == (8, 4)
    assert cfg.model.intermediate_size == 128
    assert cfg.model.tie_word_embeddings is False
    assert (cfg.job.steps, cfg.job.batch_size, cfg.job.prompt_len, cfg.job.response_len) == (40, 256, 4, 6)
    assert set(cfg.plan) == set(MODEL_STAGES)
    gen, train = cfg.plan["actor/generate"], cfg.plan["actor/train"]
    assert (gen.tp, gen.pp, gen.dp, gen.devices) == (1, 2, 1, (0, 1))
    assert (train.tp, train.pp, train.dp, train.devices) == (1, 2, 1, (0, 1))


@pytest.mark.parametrize("data", [None, {}, {"name": "x"}, {"job": {"steps": 1}}])
def test_defaults_load(data: dict[str, Any] | None) -> None:
    cfg = parse_config(data)
    assert isinstance(cfg, NereusConfig)
    assert cfg.plan == {}


def test_config_is_frozen() -> None:
    cfg = parse_config(example())
    with pytest.raises(ValueError):
        cfg.job.steps = 9  # type: ignore[misc]


def test_non_mapping_config() -> None:
    with pytest.raises(ConfigError, match="must be a mapping of sections, got list"):
        parse_config([1, 2])  # type: ignore[arg-type]


def test_with_overrides_builds_nested_keys_without_touching_the_input() -> None:
    data = example()
    before = copy.deepcopy(data)
    out = with_overrides(data, ["job.steps=2", "cluster.scheduler_address=tcp://h:8786", "new.a.b=1"])
    assert data == before
    assert out["job"]["steps"] == "2"  # values stay strings; the CLI reads them as YAML
    assert out["cluster"]["scheduler_address"] == "tcp://h:8786"
    assert out["new"] == {"a": {"b": "1"}}
    assert parse_config(with_overrides(data, ["job.steps=2"])).job.steps == 2


@pytest.mark.parametrize(
    ("item", "needle"), [("job.steps", "expected key=value"), ("job..steps=2", "empty part")]
)
def test_with_overrides_rejects_malformed_items(item: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        with_overrides(example(), [item])
    assert "\n" not in str(info.value)
    assert item in str(info.value)


@pytest.mark.parametrize(
    "name",
    ["/etc/x", "../../x", "a/b", "a\\b", "..", ".", ".hidden", "a..b", "x" * 101, "tab\tname", "nul\0"],
)
def test_a_run_name_that_is_a_path_or_not_a_name_is_refused(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"name": name})
    message = str(info.value)
    assert message.startswith("name") and "\n" not in message
    assert "at least 1 character" in message or "a run name is 1-100 letters, digits" in message


@pytest.mark.parametrize("name", ["tiny-ppo", "run_1.2", "x" * 100, "Lauf-ü", "a.b-c_d"])
def test_a_plain_run_name_is_accepted(name: str) -> None:
    assert parse_config({"name": name}).name == name
    assert name_error(name) is None


def test_trainer_logger_defaults_to_the_console_and_takes_verls_forms() -> None:
    assert parse_config({}).trainer.logger == ("console",)
    assert parse_config({"trainer": {"logger": "tensorboard"}}).trainer.logger == ("tensorboard",)
    both = parse_config({"trainer": {"logger": ["console", "mlflow"]}})
    assert both.trainer.logger == ("console", "mlflow") and both.trainer.project_name == "nereus"
    assert parse_config({"trainer": {"logger": []}}).trainer.logger == ()


@pytest.mark.parametrize(
    ("trainer", "needles"),
    [
        ({"logger": ["console", "tb"]}, ("trainer.logger[1]='tb'", "'tensorboard'", "'mlflow'", "'wandb'")),
        ({"logger": ["mlflow", "mlflow"]}, ("trainer.logger=", "names a tracker twice")),
        ({"logger": 3}, ("trainer.logger=3", "must be a list")),
        ({"loger": ["console"]}, ("trainer.loger", "did you mean logger?")),
        ({"project_name": ""}, ("trainer.project_name", "at least 1 character")),
    ],
)
def test_a_bad_trainer_section_is_one_line_naming_the_field(
    trainer: dict[str, Any], needles: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"trainer": trainer})
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
