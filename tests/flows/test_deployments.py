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


AUTOMATIONS = yaml.safe_load((ROOT / "prefect-automations.yaml").read_text())["automations"]


def _crash_automation() -> dict:
    (automation,) = [a for a in AUTOMATIONS if a["name"] == "nereus-crashed-without-heartbeat"]
    return automation


def test_the_automations_file_is_valid_for_prefect() -> None:
    from prefect.events.schemas.automations import AutomationCore

    for automation in AUTOMATIONS:
        AutomationCore.model_validate(automation)  # what `prefect automation create --from-file` does


def test_the_crash_automation_covers_every_nereus_flow() -> None:
    """A flow left out would stay Running for ever after its process dies."""
    names = set(_crash_automation()["trigger"]["match_related"]["prefect.resource.name"])
    flows = set()
    for path in sorted((ROOT / "flows").rglob("*.py")):
        dotted = path.relative_to(ROOT).with_suffix("").parts
        module = importlib.import_module(".".join(p for p in dotted if p != "__init__"))
        flows |= {obj.name for obj in vars(module).values() if isinstance(obj, Flow)}
    assert flows and flows == names


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=lambda d: d["name"])
def test_heartbeats_come_often_enough_for_the_crash_automation(deployment: dict) -> None:
    """Three heartbeats fit in the automation's window, for deployed runs and for `nereus run`."""
    from flows.cli.prefect_server import HEARTBEAT_SECONDS

    within = _crash_automation()["trigger"]["within"]
    env = deployment["work_pool"]["job_variables"]["env"]
    assert int(env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]) * 3 <= within
    assert within >= HEARTBEAT_SECONDS * 3
