"""``nereus simulate`` stopped by SIGTERM exits within seconds and keeps its finished runs; the same
command then runs only the missing ones, and writes the summary of a sweep run straight through."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli.main import main
from flows.simulate import read_sim_config, sweep_jobs, sweep_summary
from nereus_core.sim.job import run_job
from storage.sim_dir import SimDir
from tasks.sim_tasks import load_traces
from tests.support.processes import descendants, running, stop_and_time, wait_for

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "flows.cli.main"]
HEADER = "step,devices,capacity_gb,batch,prompt_len,response_mean,response_p90,response_max"


def _config(tmp_path: Path, seeds: list[int]) -> Path:
    rows = [HEADER] + [
        f"{k},16,80,1024,100,{600 + 40 * k},{1200 + 80 * k},{1800 + 120 * k}" for k in range(20)
    ]
    (tmp_path / "tiny.csv").write_text("\n".join(rows) + "\n")
    config = {
        "name": "sim-stop",
        "seeds": seeds,
        "sweep": {"mode": "dask", "workers": 2},
        "strategies": {"nereus": {"kind": "nereus"}, "static": {"kind": "static"}},
        "traces": [
            {"name": "tiny-16", "file": "tiny.csv"},
            {"name": "tiny-8", "file": "tiny.csv", "devices": 8},
        ],
    }
    path = tmp_path / f"sim-{len(seeds)}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _jobs(config: Path) -> tuple:
    cfg = read_sim_config(config)
    traces = load_traces.fn(cfg, str(config.parent))
    return cfg, traces, sweep_jobs(cfg, traces)


def _simulate(config: Path, out: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "NEREUS_CACHE_DIR": str(log.parent / "cache")}
    return subprocess.Popen(
        [*CLI, "simulate", str(config), "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.mark.timeout(600)  # two nereus starts (Prefect server, Dask) and the reference sweep
@pytest.mark.slow  # about 80 s: two nereus starts and the reference sweep
def test_a_stopped_sweep_finishes_where_it_stopped(tmp_path: Path, capsys) -> None:
    config, out, log = _config(tmp_path, [0, 1]), tmp_path / "out", tmp_path / "sim.log"
    driver = _simulate(config, out, log)
    try:

        def first_run_kept() -> bool:
            assert driver.poll() is None, log.read_text()[-3000:]
            return bool(SimDir(out).finished())

        wait_for("a first finished run", first_run_kept, limit=280, every=0.2)
        kids = descendants(driver.pid)
        seconds = stop_and_time(driver, group=True)  # as `timeout` stops a command: its whole group
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    text = log.read_text()
    print(f"\nnereus simulate: exit {seconds:.1f} s after SIGTERM, {len(kids)} child processes")
    assert driver.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert seconds < 10, text[-3000:]
    wait_for("every child process gone", lambda: not [p for p in kids if running(p)], limit=5, every=0.2)
    last = text.strip().splitlines()[-1]
    assert re.match(r"nereus: stopped by SIGTERM( after \S+ s of unwinding)?: simulation sim-stop", last), (
        last
    )
    assert last.endswith(f"nereus simulate {config} --out {out}"), last

    kept = SimDir(out).finished()
    partial = json.loads((out / "summary.json").read_text())
    assert 0 < len(kept) < 8  # a run may finish between the stopped summary and the exit: not missing then
    assert {k.replace("--", "/") for k in kept} | set(partial["missing"]) == {j.key for j in _jobs(config)[2]}
    written = {k: (out / "runs" / f"{k}.json").stat().st_mtime_ns for k in kept}

    again = _simulate(config, out, log)
    assert again.wait(timeout=280) == 0, log.read_text()[-3000:]
    assert f"{len(kept)} of 8 runs finished in {out} already" in log.read_text()
    assert {k: (out / "runs" / f"{k}.json").stat().st_mtime_ns for k in kept} == written  # not rerun

    cfg, traces, jobs = _jobs(config)
    straight = sweep_summary(cfg, traces, [run_job(job) for job in jobs], [])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["missing"] == []
    assert json.dumps(summary, sort_keys=True) == json.dumps(straight, sort_keys=True)  # NaN-safe

    # another config on the same --out: refused in one line, before anything starts
    capsys.readouterr()
    assert main(["simulate", str(_config(tmp_path, [0])), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another config" in err, err
