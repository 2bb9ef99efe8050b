"""Time from a bad input to its one-line error, and the peak memory of the YAML alias bomb (JSON out).

Runs the real ``nereus`` CLI once per hostile input (an alias bomb as a file and through
``--set``, sizes the machine cannot hold, a one-byte device slot, a path as a run name, bad
``resume --devices``, a damaged checkpoint or summary, a completed or locked run, a missing snapshot
step) and of the real-model path (``tests/support/hostile_inputs.py``: a broken model directory or
tokenizer, a bad data file, a reward function that hangs, exits, prints megabytes or returns no
score), each in its own process started from this one. For each it records the seconds from the
process start to its error line on stderr, the exit status, the number of stderr lines and the
process's peak RSS (``wait4``'s ``ru_maxrss``, the whole CLI process), and whether it left its
``--out`` directory or a reward worker behind. Prints the maximum time over the cases, the bomb's
and the worst case's peak memory; a case that does not end in one line with exit 2 (or leaves
something behind) is listed under ``failed``.

    python -m benchmarks.bench_bad_input
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from nereus_core.config import NereusConfig
from nereus_core.emu import Box, SliceSpec
from storage import write_snapshot
from storage.lock import run_lock
from storage.run_dir import RunDir
from tests.support import hostile_inputs
from tests.support.hostile_yaml import alias_bomb
from tests.support.processes import session_left

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "tiny_ppo.yaml")


def make_run(root: Path, *, summary: dict[str, Any] | None = None) -> Path:
    """A run directory of the demo config with a checkpoint record at step 2 (no snapshots)."""
    cfg = NereusConfig.model_validate(yaml.safe_load(Path(EXAMPLE).read_text()))
    run = RunDir.create(root, cfg.model_dump(mode="json"))
    plan = {k: v.model_dump(mode="json") for k, v in cfg.plan.items()}
    run.write_checkpoint(2, {"plan_id": "p", "plan": plan, "devices": 2, "response_len": 6})
    if summary is not None:
        run.write_summary(summary)
    return root


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def cases(tmp: Path) -> dict[str, list[str]]:
    """Each case's argv, its inputs written under ``tmp``."""
    (tmp / "bomb.yaml").write_text(alias_bomb(as_name=True))
    flow_bomb = "{" + alias_bomb(as_name=True).strip().replace("\n", ", ") + "}"
    truncated = make_run(tmp / "truncated")
    _truncate(truncated / "state" / "checkpoints" / "step=2.json")
    edited = make_run(tmp / "edited")
    record = json.loads((edited / "state" / "checkpoints" / "step=2.json").read_text())
    del record["plan"]
    (edited / "state" / "checkpoints" / "step=2.json").write_text(json.dumps(record))
    done = make_run(tmp / "done", summary={"status": "completed", "history": []})
    report = make_run(tmp / "report", summary={"status": "completed", "history": []})
    _truncate(report / "summary.json")
    fine = make_run(tmp / "fine")
    whole = SliceSpec((2, 3), Box((0, 0), (2, 3)))
    for step in (0, 4):
        write_snapshot(fine, "actor", step, {0: {"w": (torch.zeros(2, 3), whole)}})
    out = str(tmp / "out")
    return {
        "bomb-file": ["run", str(tmp / "bomb.yaml")],
        "bomb-set": ["run", EXAMPLE, "--out", out, "--set", f"job.scenario={flow_bomb}"],
        "batch-1e12": ["run", EXAMPLE, "--out", out, "--set", "job.batch_size=1000000000000"],
        "memory-1-byte": ["run", EXAMPLE, "--out", out, "--set", "cluster.memory_per_device=1"],
        "devices-4096": ["run", EXAMPLE, "--out", out, "--set", "cluster.devices=4096"],
        "name-path": ["run", EXAMPLE, "--set", "name=../../x"],
        "resume-devices-0": ["resume", str(fine), "--devices", "0"],
        "resume-devices-100000": ["resume", str(fine), "--devices", "100000"],
        "resume-truncated-checkpoint": ["resume", str(truncated)],
        "resume-edited-checkpoint": ["resume", str(edited)],
        "resume-completed": ["resume", str(done)],
        "report-truncated-summary": ["report", str(report)],
        "export-missing-step": ["export", str(fine), "--model", "actor", "--step", "7", "--hf", out],
        "run-locked": ["run", EXAMPLE, "--out", str(fine)],
        "resume-locked": ["resume", str(fine)],
        **{
            name: ["run", *argv, "--out", out]
            for name, (argv, _) in hostile_inputs.cases(tmp / "real").items()
        },
    }


def run_case(argv: list[str], cwd: Path) -> dict[str, Any]:
    """Start the CLI, time its first stderr line, and reap it with ``wait4`` for its peak RSS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEREUS_")} | {"PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli.main", *argv],
        cwd=cwd,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own session: what it leaves running can be found
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()
    to_line = time.perf_counter() - started
    rest = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = (first + rest).splitlines()
    return {
        "seconds_to_error_line": round(to_line, 3),
        "exit": proc.returncode,
        "stderr_lines": len(lines),
        "traceback": "Traceback" in first + rest,
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "left_behind": (cwd / "out").exists() or _left_running(proc.pid),
        "line": lines[0] if lines else "",
    }


def _left_running(session: int) -> bool:
    """Whether a process of the CLI's session (a reward worker, say) still runs a second after it."""
    time.sleep(1.0)
    return bool(session_left(session))


def reward_overhead(tmp: Path, calls: int = 2000) -> dict[str, float]:
    """Seconds of a user reward's worker start and its cost per call, beside the same function called
    in this process (``nereus_core.rewards.worker``)."""
    from nereus_core.rewards import registry
    from nereus_core.rewards.isolation import WorkerSettings
    from nereus_core.rewards.user_file import load_function

    (tmp / "good.py").write_text("def score(a, b, c, d):\n    return 1.0 if b == c else 0.0\n")
    spec = f"{tmp / 'good.py'}:score"
    here = registry.RewardFn(spec, load_function(spec), "text")  # the baseline: imported right here
    worker = registry.resolve(spec, WorkerSettings(timeout_s=10.0))
    started = time.perf_counter()
    registry.score_text(worker, "s", "4", "4", {})
    start_s = time.perf_counter() - started
    per_call = {}
    for name, reward in (("in_process", here), ("worker", worker)):
        started = time.perf_counter()
        for _ in range(calls):
            registry.score_text(reward, "s", "4", "4", {})
        per_call[name] = (time.perf_counter() - started) / calls
    worker.fn.close()
    return {
        "worker_start_s": round(start_s, 3),
        "per_call_us_in_process": round(per_call["in_process"] * 1e6, 1),
        "per_call_us_worker": round(per_call["worker"] * 1e6, 1),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        argvs = cases(tmp)
        results = {}
        for case, argv in argvs.items():
            if case.endswith("-locked"):
                with run_lock(tmp / "fine"):  # another driver holds the run
                    results[case] = run_case(argv, tmp)
            else:
                results[case] = run_case(argv, tmp)
        overhead = reward_overhead(tmp)
    failed = [
        c
        for c, r in results.items()
        if r["exit"] != 2 or r["stderr_lines"] != 1 or r["traceback"] or r["left_behind"]
    ]
    print(
        json.dumps(
            {
                "cases": len(results),
                "max_seconds_to_error_line": max(r["seconds_to_error_line"] for r in results.values()),
                "slowest_case": max(results, key=lambda c: results[c]["seconds_to_error_line"]),
                "bomb_peak_rss_mib": max(results[c]["peak_rss_mib"] for c in ("bomb-file", "bomb-set")),
                "max_peak_rss_mib": max(r["peak_rss_mib"] for r in results.values()),
                "max_peak_rss_case": max(results, key=lambda c: results[c]["peak_rss_mib"]),
                "failed": failed,
                "reward_worker": overhead,
                "per_case": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
