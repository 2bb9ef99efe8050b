"""nereus_core.preflight: the bounds a run must meet before it starts, checked against given machine facts."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus_core.config import ConfigError, NereusConfig, Workload, parse_config
from nereus_core.controller.decide import ControllerState, Observation, decide, evaluate_plan
from nereus_core.cost.hardware import get_profile
from nereus_core.cost.plan_estimate import memory_per_device
from nereus_core.plan import GlobalPlan, default_plan
from nereus_core.preflight import (
    BYTES_PER_VALUE,
    DRIVER_MEMORY_SHARE,
    LOCAL_SLOTS_PER_CPU,
    ROLLOUT_TOKEN_COLUMNS,
    Machine,
    batch_problem,
    check,
    devices_problem,
    host_memory_problem,
    host_memory_warning,
    plan_memory_problem,
    problems,
    rollout_bytes,
)
from nereus_core.rl.rollout import Rollout

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_ppo.yaml"
GiB = 1024**3
BIG = Machine(cpus=64, available_memory=512 * GiB)


def example(**sections: dict[str, Any]) -> NereusConfig:
    data = yaml.safe_load(EXAMPLE.read_text())
    for name, fields in sections.items():
        data.setdefault(name, {}).update(fields)
    return parse_config(data)


def test_the_demo_and_the_defaults_pass_on_a_small_machine() -> None:
    small = Machine(cpus=2, available_memory=2 * GiB)
    assert problems(example(), small) == []
    assert problems(NereusConfig(), small) == []


@pytest.mark.parametrize(("cpus", "ceiling"), [(1, None), (2, None), (3, None), (2, 5), (2, 100)])
def test_local_devices_are_bounded_by_the_cpus_or_an_explicit_ceiling(cpus: int, ceiling: int | None) -> None:
    machine = Machine(cpus=cpus, available_memory=None, max_local_devices=ceiling)
    limit = ceiling if ceiling is not None else cpus * LOCAL_SLOTS_PER_CPU
    fits = parse_config({"cluster": {"devices": limit}})
    over = parse_config({"cluster": {"devices": limit + 1}})
    assert devices_problem(fits, machine) is None
    problem = devices_problem(over, machine)
    assert problem is not None and f"cluster.devices={limit + 1} exceeds the {limit} device slots" in problem
    assert ("explicit ceiling" in problem) == (ceiling is not None)
    assert "cluster.scheduler_address" in problem


def test_an_external_scheduler_is_not_bounded_here() -> None:
    cfg = parse_config({"cluster": {"devices": 4096, "scheduler_address": "tcp://h:8786"}})
    assert devices_problem(cfg, Machine(cpus=1, available_memory=None)) is None


def test_scenario_growth_and_resume_devices_are_bounded_too() -> None:
    machine = Machine(cpus=1, available_memory=None)  # 4 local slots
    grows = example(job={"scenario": [{"step": 3, "devices": 9}]})
    assert "job.scenario (step 3) devices=9 exceeds the 4" in (devices_problem(grows, machine) or "")
    assert "--devices 5 exceeds the 4" in (devices_problem(example(), machine, devices=5) or "")
    assert "--devices 0: give at least 1" in (devices_problem(example(), machine, devices=0) or "")
    assert devices_problem(example(), machine, devices=4) is None


def test_the_rollout_columns_follow_the_rollout_type() -> None:
    """Per-token columns: every Rollout field but the per-sequence scores, prompts and responses as ids."""
    names = {f.name for f in dataclasses.fields(Rollout)}
    per_token = (names - {"rule_score", "score", "prompts", "responses"}) | {"ids"}
    assert set(ROLLOUT_TOKEN_COLUMNS) == per_token


def test_rollout_bytes_counts_the_longest_response_of_the_job() -> None:
    cfg = example(job={"batch_size": 64})
    tokens = cfg.job.prompt_len + 24  # the scenario's longer responses, not the first ones
    assert rollout_bytes(cfg) == 64 * tokens * len(ROLLOUT_TOKEN_COLUMNS) * BYTES_PER_VALUE


def test_a_batch_beyond_the_drivers_memory_is_refused_at_the_stated_share() -> None:
    cfg = example(job={"batch_size": 1_000_000})
    need = rollout_bytes(cfg)
    at_limit = Machine(cpus=2, available_memory=int(need / DRIVER_MEMORY_SHARE) + 1)
    below = Machine(cpus=2, available_memory=int(need / DRIVER_MEMORY_SHARE) - 64)
    assert batch_problem(cfg, at_limit) is None
    problem = batch_problem(cfg, below)
    assert problem is not None and problem.startswith("job.batch_size=1000000: a step's rollout")
    assert batch_problem(cfg, Machine(cpus=2, available_memory=None)) is None  # unknown: not checked


def test_a_trillion_sequences_are_refused_before_the_plan_is_estimated() -> None:
    cfg = example(job={"batch_size": 10**12})
    found = problems(cfg, BIG)
    assert len(found) == 1 and found[0].startswith("job.batch_size=1000000000000")


@pytest.mark.parametrize("adapt", [True, False])
def test_one_byte_per_device_is_refused_with_or_without_adapt(adapt: bool) -> None:
    cfg = example(cluster={"memory_per_device": 1}, job={"adapt": adapt})
    with pytest.raises(ConfigError, match=r"cluster.memory_per_device=1 B: the initial plan plan-\w+ needs"):
        check(cfg, BIG)


def _controller_says_fits(cfg: NereusConfig) -> bool:
    """What ``nereus plan`` reports for the config's initial plan: the controller's estimate of it."""
    plan = GlobalPlan.of(default_plan(cfg.plan, cfg.stages))
    obs = Observation.before_start(cfg)
    state = ControllerState.initial(
        cfg.models, get_profile(cfg.job.profile), stages=cfg.stages, plan=plan, devices=obs.devices
    )
    current = decide(obs, state).current
    assert current is not None
    return current.fits


# 32 and 33 MiB hold the demo plan's 29.8 MiB but not with the controller's headroom kept free
@pytest.mark.parametrize("mib", [1, 8, 32, 33, 34, 40, 64])
@pytest.mark.parametrize("partial_plan", [False, True])
def test_the_plan_check_agrees_with_the_controller(mib: int, partial_plan: bool) -> None:
    """Refused exactly when the controller (``nereus plan``) finds the initial plan over its usable memory;
    a plan that leaves model-stages out is checked with their defaults filled in."""
    cfg = example(cluster={"memory_per_device": mib * 2**20})
    if partial_plan:
        data = cfg.model_dump(mode="json")
        data["plan"] = {"actor/train": data["plan"]["actor/train"]}
        cfg = parse_config(data)
    assert (plan_memory_problem(cfg) is None) == _controller_says_fits(cfg)


def test_a_plan_over_memory_is_refused_naming_a_stage_and_the_bytes_with_each_memory_choice() -> None:
    """The refusal names the train stage whose memory choices lower the busiest slot most and the bytes
    with each, and the claim holds: the config with that stage on the leanest choice needs exactly
    the bytes the line stated."""
    cfg = example(cluster={"memory_per_device": 22 * 2**20})
    line = plan_memory_problem(cfg)
    assert line is not None and "\n" not in line
    found = re.search(r"or change (\S+)'s memory choices \(busiest slot with (.*?)\) \(nereus plan", line)
    assert found, line
    stage, listed = found.groups()
    choices = re.findall(r"\{([^}]*)\} ([\d.]+ [KMG]iB)", listed)
    assert choices, listed
    fields, stated = min(
        choices, key=lambda c: float(c[1].split()[0]) * {"K": 1, "M": 2**10, "G": 2**20}[c[1].split()[1][0]]
    )
    data = cfg.model_dump(mode="json")
    choice = dict(item.split(": ") for item in fields.split(", "))
    data["plan"][stage] |= {k: v == "true" if v in ("true", "false") else v for k, v in choice.items()}
    again = plan_memory_problem(parse_config(data))
    assert again is None or f"needs {stated} on its busiest slot" in again, (stated, again)


def test_both_outcomes_occur_in_the_agreement_table() -> None:
    """The table above is only a test if some sizes fit and some do not."""
    fits = [_controller_says_fits(example(cluster={"memory_per_device": m * 2**20})) for m in (32, 34)]
    assert fits == [False, True]


def test_resume_does_not_check_the_initial_plan() -> None:
    cfg = example(cluster={"memory_per_device": 1})
    assert problems(cfg, BIG, resume=True) == []
    assert len(problems(cfg, BIG)) == 1


# Llama-3.1-8B's shapes (such a config on CPU died as "Worker holding Actor was lost").
LLAMA_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
}


def _llama_8b(**cluster: Any) -> NereusConfig:
    """An 8B job whose initial plan fits its (large) slots, so that only the machine can refuse it."""
    data = {"model": LLAMA_8B, "job": {"batch_size": 8, "prompt_len": 16, "response_len": 16}}
    return parse_config({**data, "cluster": {"devices": 4, "memory_per_device": "512GiB", **cluster}})


def test_a_plan_beyond_the_machine_s_memory_is_refused_on_a_local_cluster_only() -> None:
    cfg = _llama_8b()
    machine = Machine(cpus=64, available_memory=20 * GiB)
    assert plan_memory_problem(cfg) is None  # it fits its slots ...
    found = problems(cfg, machine)  # ... but not this machine
    assert len(found) == 1 and "\n" not in found[0]
    assert found[0].startswith("the initial plan plan-") and "more than the 20.0 GiB" in found[0]
    assert "cluster.scheduler_address" in found[0]  # the fix
    with pytest.raises(ConfigError, match="this machine has available"):
        check(cfg, machine)
    remote = _llama_8b(scheduler_address="tcp://127.0.0.1:8786")
    assert host_memory_problem(remote, machine) is None
    assert host_memory_problem(cfg, dataclasses.replace(machine, available_memory=None)) is None
    assert host_memory_problem(cfg, dataclasses.replace(machine, available_memory=2**50)) is None


def test_the_host_check_sums_the_memory_model_over_the_plan_s_slots() -> None:
    """The bound is the cost model's per-slot memory added over the slots, not a guess."""
    cfg = _llama_8b()
    plan = GlobalPlan.of(default_plan(cfg.plan, cfg.stages))
    state = ControllerState.initial(cfg.models, get_profile(cfg.job.profile), stages=cfg.stages, plan=plan)
    estimate = evaluate_plan(plan, Workload.from_config(cfg), state, int(cfg.cluster.memory_per_device))
    need = sum(memory_per_device(plan, {s: e.memory for s, e in estimate.stages.items()}).values())
    assert host_memory_problem(cfg, Machine(cpus=64, available_memory=need)) is None
    assert host_memory_problem(cfg, Machine(cpus=64, available_memory=need - 1)) is not None


def test_declared_capacity_beyond_the_machine_is_one_warning_line_not_a_refusal() -> None:
    cfg = example(cluster={"memory_per_device": "8GiB"})  # the demo's 4 slots
    machine = Machine(cpus=2, available_memory=16 * GiB)
    line = host_memory_warning(cfg, machine)
    assert line is not None and "\n" not in line
    assert "cluster.memory_per_device=8.0 GiB x 4 local device slots = 32.0 GiB" in line
    assert "killed (out of memory)" in line and "lower cluster.memory_per_device" in line
    assert problems(cfg, machine) == []  # the demo itself needs far less
    assert host_memory_warning(cfg, Machine(cpus=2, available_memory=32 * GiB)) is None
    grows = example(cluster={"memory_per_device": "4GiB"}, job={"scenario": [{"step": 3, "devices": 8}]})
    assert "x 8 local device slots" in (host_memory_warning(grows, machine) or "")
    assert "x 8 local device slots" in (host_memory_warning(grows, machine, devices=5) or "")
    assert "x 12 local device slots" in (host_memory_warning(grows, machine, devices=12) or "")
    remote = example(cluster={"memory_per_device": "8GiB", "scheduler_address": "tcp://127.0.0.1:8786"})
    assert host_memory_warning(remote, machine) is None


def test_each_slot_s_predicted_bytes_follow_the_plan_in_force_and_the_lengths() -> None:
    """The prediction a lost worker is named with: every slot of the plan in force, and more bytes
    when responses grow (the memory model's activations and KV cache grow with them)."""
    from nereus_core.job import start
    from nereus_core.preflight import predicted_slot_bytes

    cfg = example()
    state = start(cfg)
    slots = {d for layout in state.layouts.values() for d in layout.devices}
    short = predicted_slot_bytes(state)
    assert set(short) == slots and all(n > 0 for n in short.values())
    longer = predicted_slot_bytes(dataclasses.replace(state, config=example(job={"response_len": 24})))
    assert all(longer[d] > short[d] for d in slots)
