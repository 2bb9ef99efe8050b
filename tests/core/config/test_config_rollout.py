"""nereus_core.config.rollout: the rollout section's defaults, and what it refuses in one line."""

from __future__ import annotations

from typing import Any

import pytest

from nereus_core.config import ConfigError, parse_config
from nereus_core.config import rollout as rollout_config


def grpo(**rollout: Any) -> dict[str, Any]:
    return {
        "algorithm": {"name": "grpo", "group_size": 2},
        "ppo": {"kl_coef": 0.0, "use_kl_loss": False},
        "rollout": rollout,
    }


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout_config, "vllm_installed", lambda: True)


def test_default_is_nereus() -> None:
    cfg = parse_config({})
    assert cfg.rollout.engine == "nereus" and not cfg.rollout.uses_vllm


def test_vllm_settings_keep_verl_names(installed: None) -> None:
    cfg = parse_config(
        grpo(
            engine="vllm",
            gpu_memory_utilization=0.7,
            max_num_seqs=64,
            enforce_eager=True,
            kv_cache_memory_bytes="64MiB",
        )
    )
    assert cfg.rollout.uses_vllm
    assert cfg.rollout.gpu_memory_utilization == 0.7 and cfg.rollout.max_num_seqs == 64
    assert cfg.rollout.kv_cache_memory_bytes == 64 * 2**20


def test_vllm_not_installed_is_refused_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout_config, "vllm_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm but vLLM is not installed.*\.\[vllm\]"):
        parse_config(grpo(engine="vllm"))
    parse_config(grpo(engine="nereus"))  # nereus needs nothing more


def test_installed_check_imports_nothing() -> None:
    assert isinstance(rollout_config.vllm_installed(), bool)


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"plan": {"actor/generate": {"tp": 1, "pp": 2, "dp": 1, "devices": [0, 1]}}}, "pp=2"),
        ({"rollout": {"engine": "vllm", "gpu_memory_utilization": 1.5}}, "gpu_memory_utilization"),
        ({"rollout": {"engine": "vllm", "engine_kind": "x"}}, "engine_kind"),
    ],
)
def test_vllm_refusals_are_one_line(change: dict[str, Any], words: str) -> None:
    data = {**grpo(engine="vllm"), **change}
    with pytest.raises(ConfigError, match=words) as err:
        parse_config(data)
    assert "\n" not in str(err.value)


@pytest.mark.usefixtures("installed")
def test_an_adaptive_vllm_job_is_accepted() -> None:
    """A switch rebuilds the engines (flows/job/engine_switch.py), so adapting and scenarios are allowed."""
    data = {**grpo(engine="vllm"), "job": {"adapt": True, "scenario": [{"step": 1, "devices": 4}]}}
    assert parse_config(data).job.adapt


def test_pipeline_generation_is_fine_on_nereus() -> None:
    data = grpo(engine="nereus")
    data["plan"] = {"actor/generate": {"tp": 1, "pp": 2, "dp": 1, "devices": [0, 1]}}
    assert parse_config(data).plan["actor/generate"].pp == 2
