"""prefect.yaml: every deployment names a flow that exists and parameters that flow takes."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml
from prefect import Flow

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]


def test_demo_and_simulation_are_deployed() -> None:
    assert {d["name"] for d in DEPLOYMENTS} >= {"ppo-demo", "simulate-paper", "selfcheck-demo"}


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=lambda d: d["name"])
def test_entrypoint_is_a_flow_taking_the_parameters(deployment: dict) -> None:
    path, name = deployment["entrypoint"].split(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    flow = getattr(module, name)
    assert isinstance(flow, Flow)
    inspect.signature(flow.fn).bind(**deployment.get("parameters", {}))  # raises on a stray parameter
    config = deployment.get("parameters", {}).get("config")
    assert config is None or (ROOT / config).is_file()
