"""nereus_core.controller.features: the one rule of what the real job runs, read by the job's
controller and by the simulator's Nereus alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nereus_core import job as job_rules
from nereus_core.config import ConfigError, parse_config
from nereus_core.controller import features
from nereus_core.controller.state import ControllerSettings
from nereus_core.sim.config import parse_sim_config
from nereus_core.sim.job import make_strategy

ROOT = Path(__file__).resolve().parents[2]


def test_the_rule_states_what_the_job_runs() -> None:
    assert features.RECOVERY_MODES == ("async", "sync", "none")
    assert features.DEFAULT_RECOVERY == "async" == ControllerSettings().switch_recovery
    assert features.SNAPSHOT_EVERY == 10
    assert features.PERIODIC_CHECKPOINT == "sync"
    # The controller's defaults ask for probes, which the runtime runs (tasks/probes.py); it has no
    # one-step off-policy overlap.
    assert features.lacking(ControllerSettings()) == []
    assert features.lacking(ControllerSettings(overlap_disaggregated=True)) == ["overlap_disaggregated"]
    settings = features.runtime_settings(
        ControllerSettings(overlap_disaggregated=True, margin=0.3, probe_every=7)
    )
    assert (settings.probe_every, settings.overlap_disaggregated, settings.margin) == (7, False, 0.3)
    assert features.lacking(settings) == []


def test_the_jobs_controller_has_only_what_the_runtime_has() -> None:
    data = yaml.safe_load((ROOT / "examples" / "tiny_ppo.yaml").read_text())
    settings = job_rules.controller_settings(parse_config(data))
    assert features.lacking(settings) == []
    assert settings.transition_pricing == "schedule"  # the job's own settings are kept


def sim_config(**overrides: object):
    return parse_sim_config({"traces": [{"name": "t", "file": "unused.csv"}], **overrides})


@pytest.mark.parametrize("kind", ["nereus", "static"])
def test_the_simulated_nereus_has_only_what_the_runtime_has(kind: str) -> None:
    """Fails if the simulator's Nereus (or static, on the same runtime) runs a feature the rule lacks."""
    cfg = parse_sim_config(yaml.safe_load((ROOT / "examples" / "paper_sim.yaml").read_text()))
    for name, spec in cfg.strategies.items():
        if spec.kind == kind:
            assert features.lacking(make_strategy(cfg, name).settings) == [], name
    assert features.lacking(make_strategy(sim_config(), "nereus").settings) == []


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"controller": {"overlap_disaggregated": True}}, "controller.overlap_disaggregated: "),
        (
            {"strategies": {"fast": {"kind": "nereus", "controller": {"overlap_disaggregated": True}}}},
            "strategies.fast.controller.overlap_disaggregated: ",
        ),
        (
            {"strategies": {"s": {"kind": "static", "controller": {"overlap_disaggregated": True}}}},
            "strategies.s.controller.overlap_disaggregated: ",
        ),
    ],
)
def test_a_sim_config_asking_nereus_for_a_missing_feature_is_refused_in_one_line(
    data: dict, needle: str
) -> None:
    with pytest.raises(ConfigError) as err:
        sim_config(**data)
    line = str(err.value)
    assert line.startswith(needle) and "\n" not in line
    assert "remove the field" in line and "features.py" in line


def test_the_peers_settings_are_not_nereus_features() -> None:
    """verl and OpenRLHF take the controller settings only for their memory headroom."""
    cfg = sim_config(strategies={"verl": {"kind": "verl", "controller": {"probe_every": 5}}})
    assert cfg.strategies["verl"].controller is not None


@pytest.mark.parametrize("flag", [False, True])
def test_the_simulated_nereus_recomputes_as_its_models_launch_flag_says(
    monkeypatch: pytest.MonkeyPatch, flag: bool
) -> None:
    """The runtime recomputes train passes only with model.gradient_checkpointing, for the whole run
    (features.activation_recompute), so the simulated Nereus and static run every train stage with that
    flag, never with the world's recompute-where-nothing-fits option (sim/peers.py: the peers' flags)."""
    from nereus_core.cost.hardware import H100_SXM
    from nereus_core.sim.trace import parse_trace
    from nereus_core.sim.world import World

    cfg = sim_config(model={**sim_config().model.model_dump(), "gradient_checkpointing": flag})
    assert features.activation_recompute(cfg.model) is flag
    rows = ["step,devices,capacity_gb,batch,prompt_len,response_mean,response_p90,response_max"]
    rows += [f"{k},16,80,1024,100,600,1200,1800" for k in range(2)]
    tr = parse_trace("\n".join(rows) + "\n", name="t")
    asked: list[tuple[str, object]] = []
    tune = World.tune

    def spy(self, plan, work, usable, *, recompute=None, keep=frozenset()):
        trains = [s for s in plan.layouts if s.endswith("/train")]
        asked.append((current, None if recompute is None else {recompute.get(s) for s in trains}))
        return tune(self, plan, work, usable, recompute=recompute, keep=keep)

    monkeypatch.setattr(World, "tune", spy)
    for current in ("nereus", "static"):
        strategy = make_strategy(cfg, current)
        world = World(tr, cfg.model, H100_SXM, cfg.noise, 0, stages=cfg.stages)
        strategy.begin(world)
        asked.clear()
        world.begin_step(0)
        strategy.prepare(0, world)
        assert asked and all(flags == {flag} for _, flags in asked), (current, asked)
        assert world.recomputed == ({"actor/train", "critic/train"} if flag else set()), current
