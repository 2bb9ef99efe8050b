"""What the simulated Nereus pays on its runtime: its switches' recovery points and verification, a
periodic checkpoint every ``snapshot_every`` steps, and no probes (``controller.features``)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from nereus_core.config import LLAMA_3_8B
from nereus_core.cost.hardware import H100_SXM
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan
from nereus_core.sim import checkpoints, probes
from nereus_core.sim.checkpoints import SwitchWrites
from nereus_core.sim.config import NoiseSettings, parse_sim_config
from nereus_core.sim.job import SimJob, run_job
from nereus_core.sim.loop import simulate
from nereus_core.sim.shapes import model_size
from nereus_core.sim.strategies import FixedStrategy
from nereus_core.sim.trace import parse_trace
from nereus_core.sim.world import World

ROOT = Path(__file__).resolve().parents[3]
HEADER = "step,devices,capacity_gb,batch,prompt_len,response_mean,response_p90,response_max"
QUIET = NoiseSettings(stage_sigma=0, transition_sigma=0).model_dump()


def trace(steps: int, devices=lambda k: 16, capacity: float = 80.0):
    rows = [HEADER] + [
        f"{k},{devices(k)},{capacity},1024,100,{600 + 5 * k},{2 * (600 + 5 * k)},{3 * (600 + 5 * k)}"
        for k in range(steps)
    ]
    return parse_trace("\n".join(rows) + "\n", name="t")


def config(**overrides: object):
    return parse_sim_config({"traces": [{"name": "t", "file": "unused.csv"}], "noise": QUIET, **overrides})


def test_the_worlds_write_rates_reproduce_their_sources() -> None:
    params = {"reference": model_size(LLAMA_3_8B).params}  # 8.03e9: 16.06 GB of bf16 weights
    one_node = {"reference/infer": Layout.contiguous(dp=8)}
    assert checkpoints.write_s(one_node, params, 8) == pytest.approx(8.94, rel=0.01)  # torchacc#16
    one_reader = {"reference/infer": Layout.contiguous()}
    assert checkpoints.read_s(one_reader, params) == pytest.approx(19.84, rel=0.01)
    assert checkpoints.read_s(one_node, params) == pytest.approx(19.84 / 8, rel=0.01)  # every rank reads
    two_nodes = {"reference/infer": Layout.contiguous(dp=16)}
    assert checkpoints.write_s(two_nodes, params, 8) == pytest.approx(8.94 / 2, rel=0.01)  # nodes at once
    assert checkpoints.staging_s(one_node, params) == checkpoints.STAGING_FLOOR_S  # 2 GB over PCIe
    # A trained model's state is its fp32 parameters and two moments: 6x its bf16 weights.
    trained = {"actor/train": Layout.contiguous(dp=8)}
    actor = {"actor": params["reference"]}
    assert checkpoints.write_s(trained, actor, 8) == pytest.approx(6 * 8.94, rel=0.01)


def test_the_world_shares_no_formula_with_the_cost_model() -> None:
    """``sim.checkpoints`` takes nothing from the cost model (the runtime's rule of what a switch
    writes is the config's, ``config.recovery_write``, read by both)."""
    tree = ast.parse((ROOT / "nereus_core" / "sim" / "checkpoints.py").read_text())
    taken = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nereus_core.cost")
        for alias in node.names
    }
    assert taken == set()
    assert "recovery_write" in (ROOT / "nereus_core" / "sim" / "checkpoints.py").read_text()


def test_the_worlds_transitions_take_nothing_from_the_cost_model_or_the_controller() -> None:
    """``sim.transitions`` prices moved bytes, fixed costs and the weight sync with its own arithmetic."""
    tree = ast.parse((ROOT / "nereus_core" / "sim" / "transitions.py").read_text())
    nodes = list(ast.walk(tree))
    imported = {n.module or "" for n in nodes if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
    assert "nereus_core.layout" in imported  # the check reads the module's imports
    assert not {m for m in imported if m.startswith(("nereus_core.cost", "nereus_core.controller"))}


def test_moved_bytes_are_what_each_new_device_lacks_of_its_piece() -> None:
    from nereus_core.sim.transitions import IB_BYTES_PER_S, NVLINK_BYTES_PER_S, moved_s

    gb = 1e9
    whole = {"actor/train": Layout.contiguous(dp=2)}  # devices 0 and 1 each hold everything
    halves = {"actor/train": Layout.contiguous(tp=2)}  # device 0 the first half, 1 the second
    size = {"actor/train": 12 * gb}
    assert moved_s(whole, whole, size, 8) == 0.0  # unchanged: nothing moves
    assert moved_s(whole, halves, size, 8) == 0.0  # each keeps the half it needs
    # back to whole copies: each device lacks the other half, over NVLink (an old holder in its node)
    assert moved_s(halves, whole, size, 8) == pytest.approx(6 * gb / NVLINK_BYTES_PER_S)
    # onto the next node: everything, over InfiniBand, each device its own half
    away = {"actor/train": Layout.contiguous(tp=2, first=8)}
    assert moved_s(halves, away, size, 8) == pytest.approx(6 * gb / IB_BYTES_PER_S)
    # pipeline-major pieces: tp2 pp2 -> pp2 on devices 0-1 keeps a quarter of each new half on device 0
    grid = {"actor/train": Layout.contiguous(tp=2, pp=2)}
    pipe = {"actor/train": Layout.contiguous(pp=2)}
    received = {0: 6 * gb - 3 * gb, 1: 6 * gb - 0.0}  # device 1 held [1/4, 1/2), needs [1/2, 1)
    assert moved_s(grid, pipe, size, 8) == pytest.approx(max(received.values()) / NVLINK_BYTES_PER_S)


def plan_on(devices: int) -> GlobalPlan:
    layouts = {s: Layout.contiguous(dp=devices) for s in config().stages}
    return GlobalPlan.model_construct(placement="colocated", layouts=layouts)


def test_a_switch_pays_its_recovery_point_and_a_device_change_writes_and_reads_it() -> None:
    cfg = config()
    tr = trace(4, devices=lambda k: 16 if k < 2 else 32)
    world = World(tr, cfg.model, H100_SXM, cfg.noise, 0, stages=cfg.stages)
    a, b = plan_on(16), plan_on(16).model_copy(update={"placement": "other"})
    peer = world.transition_s(0, a, b)  # a framework that writes nothing
    staged = world.transition_s(0, a, b, SwitchWrites("async"))
    written = world.transition_s(0, a, b, SwitchWrites("sync"))
    verified = world.transition_s(0, a, b, SwitchWrites("none", verify=True))
    layouts = dict(a.layouts)
    assert staged == pytest.approx(peer + checkpoints.staging_s(layouts, world.params))
    assert written == pytest.approx(peer + checkpoints.write_s(layouts, world.params, 8))
    assert verified == pytest.approx(peer + checkpoints.verify_s(dict(b.layouts), world.params))
    # After step 1 the devices change (16 -> 32): the checkpoint is written whatever the mode, then read.
    c = plan_on(32)
    new = dict(c.layouts)
    durable = world.transition_s(1, a, c, SwitchWrites("none"))
    extra = checkpoints.write_s(layouts, world.params, 8) + checkpoints.read_s(new, world.params)
    assert durable == pytest.approx(world.transition_s(1, a, c) + extra)


def test_nereus_and_static_pay_periodic_checkpoints_and_the_peers_theirs() -> None:
    cfg = config(snapshot_every=2)
    tr = trace(5)
    for name in ("nereus", "static"):
        result = run_job(SimJob(cfg, tr, name, 0))
        charged = [r["step"] for r in result.records if r["checkpoint_s"] > 0]
        assert charged == [1, 3, 4], name  # every 2 steps, and after the last
        s = result.summary
        assert s["checkpoint_s_total"] == pytest.approx(sum(r["checkpoint_s"] for r in result.records))
        steps = sum(r["step_s"] for r in result.records)
        assert s["total_s"] == pytest.approx(steps + s["transition_s_total"] + s["checkpoint_s_total"])
    verl = run_job(SimJob(cfg, tr, "verl", 0)).records  # every 20 steps (sim/peers.py), and after the last
    assert [r["step"] for r in verl if r["checkpoint_s"] > 0] == [4]
    last_only = run_job(SimJob(config(snapshot_every=0), tr, "static", 0)).records
    assert [r["step"] for r in last_only if r["checkpoint_s"] > 0] == [4]


class Pinned(FixedStrategy):
    """A fixed plan on Nereus's runtime, checkpointing every ``every`` steps."""

    def __init__(self, plan: GlobalPlan, every: int | None) -> None:
        super().__init__("pinned", headroom=0.0)
        self.plan, self.checkpoint_every = plan, every

    def initial_plan(self, world: World) -> GlobalPlan:
        return self.plan


def test_a_failed_step_reruns_the_steps_since_the_last_checkpoint() -> None:
    cfg = config()
    squeezed = trace(5, capacity=8.0)  # nothing fits in 8 GB: every step fails
    world = World(squeezed, cfg.model, H100_SXM, cfg.noise, 0, stages=cfg.stages)
    plan = plan_on(16)
    records, _ = simulate(world, Pinned(plan, 2), trace="t", seed=0)
    since = 0.0
    for r in records:
        assert not r["fits"]
        restart = world.relaunch_s(r["step"], plan)  # a new engine and groups, every device's read
        assert restart > world.restart_s(plan)
        assert r["restart_s"] == pytest.approx(r["stages_s"] + restart + since)
        since = 0.0 if r["checkpoint_s"] > 0 else since + r["stages_s"]
    every, _ = simulate(world, Pinned(plan, None), trace="t", seed=0)  # as if checkpointed every step
    assert all(
        r["restart_s"] == pytest.approx(r["stages_s"] + world.relaunch_s(r["step"], plan)) for r in every
    )


def test_the_simulated_nereus_probes_as_the_job_does_and_pays_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job runs the probes its controller asks for (tasks/probes.py), so the simulated Nereus asks
    for them too (every 10 steps by default), and every answered probe is charged with its decision."""
    asked: list = []
    answer = probes.answer

    def recorded(world, k, requests):
        asked.extend(requests)
        return answer(world, k, requests)

    monkeypatch.setattr(probes, "answer", recorded)
    cfg = config(controller={"margin": 0.2}, decision={"seconds": 0.0})
    result = run_job(SimJob(cfg, trace(12), "nereus", 0))
    assert asked and {str(r.stage) for r in asked} <= {"actor/generate", "actor/train"}
    assert result.summary["controller_s_total"] > 0 and len(result.records) == 12
    assert not math.isnan(result.summary["total_s"])
