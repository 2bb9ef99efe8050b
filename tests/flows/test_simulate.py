"""flows.simulate: the flow writes the documented outputs; the Dask path gives the same runs; CLI errors."""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import yaml

from flows.cli.main import main
from flows.simulate import run_simulation
from nereus_core.sim.config import parse_sim_config
from nereus_core.sim.job import SimJob, run_job
from nereus_core.sim.trace import parse_trace
from tasks.sim_tasks import RunLost, SweepCluster, execute

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

HEADER = "step,devices,capacity_gb,batch,prompt_len,response_mean,response_p90,response_max"
FIELDS = (
    "mean_step_s",
    "throughput_tokens_per_s",
    "transitions",
    "transition_s_total",
    "transition_overhead_frac",
    "floor_step_s",
    "step_over_floor",
)


def write_trace(path: Path, steps: int = 5) -> Path:
    rows = [HEADER] + [
        f"{k},16,80,1024,100,{600 + 40 * k},{1200 + 80 * k},{1800 + 120 * k}" for k in range(steps)
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def sim_config(tmp_path: Path, **extra) -> dict:
    write_trace(tmp_path / "tiny.csv")
    return {
        "name": "sim-test",
        "seeds": [0],
        "sweep": {"mode": "inprocess"},
        "strategies": {
            "nereus": {"kind": "nereus"},
            "static": {"kind": "static"},
            "verl": {"kind": "verl", "tune_steps": 2},
        },
        "traces": [
            {"name": "tiny-16", "file": "tiny.csv"},
            {
                "name": "tiny-8",
                "file": "tiny.csv",
                "devices": 8,
                "steps": 3,
                "strategies": ["nereus", "static"],
            },
        ],
        **extra,
    }


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("sim")
    cfg = tmp / "sim.yaml"
    cfg.write_text(yaml.safe_dump(sim_config(tmp)))
    out = tmp / "out"
    run_simulation(cfg, out)
    return out


def test_the_flow_writes_summary_steps_and_plots(out_dir: Path) -> None:
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["adaptive"] == "nereus" and summary["seeds"] == [0]
    tiny = summary["traces"]["tiny-16"]
    assert tiny["steps"] == 5 and tiny["devices_max"] == 16
    for name in ("nereus", "static", "verl"):
        per = tiny["strategies"][name]
        assert all(isinstance(per[f], int | float) and not math.isnan(per[f]) for f in FIELDS), name
        assert per["throughput_tokens_per_s"] > 0 and 0 <= per["transition_overhead_frac"] < 1
        # One floor per (trace, seed), below every strategy's mean step.
        assert (
            per["floor_step_s"] == tiny["strategies"]["nereus"]["floor_step_s"] and per["step_over_floor"] > 1
        )
    assert set(tiny["compare"]) == {"static", "verl"}
    assert set(summary["traces"]["tiny-8"]["strategies"]) == {"nereus", "static"}
    steps = pq.read_table(out_dir / "steps.parquet").to_pylist()
    assert len(steps) == 5 * 3 + 3 * 2
    assert {"trace", "strategy", "seed", "step", "step_s", "transition_s", "decide_s", "plan_id"} <= set(
        steps[0]
    )
    plots = sorted(p.name for p in (out_dir / "plots").iterdir())
    assert plots == ["step_time_tiny-16.png", "step_time_tiny-8.png", "throughput_ratios.png"]
    timing = json.loads((out_dir / "timing.json").read_text())
    assert timing["wall_s"] > 0 and timing["controller_calls"] == 5 + 3
    assert json.loads((out_dir / "plans.json").read_text())


def test_runs_on_dask_workers_match_runs_in_process(tmp_path: Path) -> None:
    cfg = parse_sim_config(sim_config(tmp_path, sweep={"mode": "dask", "workers": 1}))
    tr = parse_trace((tmp_path / "tiny.csv").read_text(), name="tiny-16", steps=3)
    job = SimJob(cfg, tr, "nereus", 0)
    with SweepCluster(cfg.sweep, runs=1) as cluster:
        assert cluster.address is not None
        remote = execute(job, cluster.address)
    assert remote.summary == run_job(job).summary


def _is_worker(proc: psutil.Process) -> bool:
    """Dask's worker process: a multiprocessing child (spawned, or forked by the fork server), titled
    ``dask worker [...]`` where the ``setproctitle`` package is installed (the vLLM extra brings it)."""
    try:
        line = " ".join(proc.cmdline())
        parent = proc.parent()
        server = parent is not None and "forkserver import main" in " ".join(parent.cmdline())
    except psutil.Error:
        return False
    return "spawn_main" in line or line.startswith("dask worker") or server


def test_a_run_whose_worker_dies_is_lost_in_one_line_naming_it(tmp_path: Path) -> None:
    cfg = parse_sim_config(sim_config(tmp_path, sweep={"mode": "dask", "workers": 1}))
    tr = parse_trace(write_trace(tmp_path / "long.csv", steps=400).read_text(), name="tiny-16")
    job = SimJob(cfg, tr, "nereus", 0)  # tens of seconds: still running when its worker is killed
    with SweepCluster(cfg.sweep, runs=1) as cluster, ThreadPoolExecutor(1) as pool:
        running = pool.submit(execute, job, cluster.address)
        workers: list[psutil.Process] = []
        deadline = time.monotonic() + 30  # the worker process starts within seconds on a loaded machine
        while not workers and time.monotonic() < deadline:
            time.sleep(0.5)
            workers = [p for p in psutil.Process().children(recursive=True) if _is_worker(p)]
        children = [" ".join(p.cmdline())[:80] for p in psutil.Process().children(recursive=True)]
        assert workers and not running.done(), children
        for proc in workers:
            proc.kill()
        with pytest.raises(RunLost) as err:
            running.result(timeout=60)
    assert str(err.value) == "run tiny-16/nereus/seed0 was lost: the Dask worker running it died"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (None, "no such file"),
        ("traces: []\n", "traces: must have at least 1 item"),
        ("traces: [{name: t, file: tiny.csv}]\nbogus: 1\n", "bogus: unknown field"),
        ("traces: [{name: t, file: missing.csv}]\n", "traces.t.file: cannot read"),
        ("traces: [{name: t, file: bad.csv}]\n", "traces.t.file"),
    ],
)
def test_simulate_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys, text: str | None, needle: str
) -> None:
    write_trace(tmp_path / "tiny.csv")
    (tmp_path / "bad.csv").write_text("step,devices\n0,1\n")
    path = tmp_path / "sim.yaml"
    if text is not None:
        path.write_text(text)
    assert main(["simulate", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nereus: error: ") and needle in err[0], err
    assert not (tmp_path / "o").exists()
