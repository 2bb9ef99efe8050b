"""Nereus as Prefect's users run it, against a Prefect server (tests/flows/test_killed_driver.py:
``nereus run`` with its temporary one, killed).

- A flow run whose process is killed becomes Crashed on its own (heartbeats every 30 s and the
  automation in prefect-automations.yaml), so that the UI offers Retry; a run that completes stays
  Completed. Against a real ``prefect server start`` on a free loopback port, PREFECT_HOME in a
  temporary folder; skipped, with the reason, when the server does not start within 120 s.
- (slow) A deployed ``nereus-ppo`` run (prefect.yaml's ``ppo-demo`` with a small config, a work
  pool, a worker) killed with SIGKILL after its first checkpoint is shown Crashed (by its worker,
  within seconds); ``prefect flow-run retry`` runs the same flow run again, which resumes its own
  run directory and completes.

The automation's flow runs are a tiny flow named like Nereus's PPO flow (the automation matches
Nereus's flows by name), not a deployed run: the worker of a deployed run already marks it Crashed
when the flow's process exits; the automation is for a run whose process dies with no one watching
it, as ``nereus run`` against a server, or a worker lost with its runs.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.job_configs import FAULT_JOB
from tests.support.processes import running, wait_for

ROOT = Path(__file__).resolve().parents[3]
SERVER_START_SECONDS = 120.0
HEARTBEAT_SECONDS = 30
CRASHED_WITHIN = 240.0  # 90 s without heartbeat after the last one (<= 30 s before the kill), plus slack

TINY_FLOW = """
import sys, time
from prefect import flow
from prefect.runtime import flow_run

@flow(name="nereus-ppo")
def tiny(seconds: float) -> None:
    print(flow_run.id, flush=True)
    time.sleep(seconds)

tiny(float(sys.argv[1]))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, *, timeout: float = 5.0) -> dict | list | None:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.loads(answer.read() or b"null")


def _stop_group(proc: subprocess.Popen) -> None:
    """End ``proc`` and everything in its session (it was started with one of its own)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A Prefect server of its own; the environment of a client that talks to it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = (home / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env | {"PREFECT_UI_ENABLED": "false"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            try:
                _get(f"{url}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"the Prefect server did not start within {SERVER_START_SECONDS:.0f} s")
                time.sleep(1)
        yield env | {"PREFECT_API_URL": url}
    finally:
        _stop_group(proc)
        log.close()


def _state(api: str, run_id: str) -> str | None:
    try:
        run = _get(f"{api}/flow_runs/{run_id}", timeout=15)
    except OSError:  # a server slowed down by a loaded machine: ask again at the next poll
        return None
    return run["state"]["type"] if run and run.get("state") else None


def _heartbeats(api: str, run_id: str, event: str = "prefect.flow-run.heartbeat") -> int:
    """How many ``event`` events name the flow run ``run_id`` (as their resource or a related one)."""
    body = json.dumps(
        {
            "filter": {
                "event": {"name": [event]},
                "any_resource": {"id": [f"prefect.flow-run.{run_id}"]},
            }
        }
    ).encode()
    request = urllib.request.Request(
        f"{api}/events/filter", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=15) as answer:
            return len(json.loads(answer.read())["events"])
    except OSError:  # as in _state
        return 0


def _start_tiny_run(env: dict[str, str], tmp: Path, seconds: float) -> tuple[subprocess.Popen, str]:
    script = tmp / "tiny_flow.py"
    script.write_text(TINY_FLOW)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(seconds)],
        env=env | {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_SECONDS)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    run_id = proc.stdout.readline().strip()
    assert run_id, "the tiny flow printed no flow run id"
    return proc, run_id


@pytest.mark.slow  # about 100 s: a real Prefect server, a flow run killed
def test_a_killed_flow_run_becomes_crashed_and_a_finished_one_stays_completed(
    server: dict[str, str], tmp_path: Path
) -> None:
    api = server["PREFECT_API_URL"]
    created = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect",
            "automation",
            "create",
            "--from-file",
            str(ROOT / "prefect-automations.yaml"),
        ],
        env=server,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert created.returncode == 0, created.stdout + created.stderr
    killed, killed_id = _start_tiny_run(server, tmp_path, seconds=600)
    finished, finished_id = _start_tiny_run(server, tmp_path, seconds=40)  # > one heartbeat, then done
    try:
        wait_for("a heartbeat", lambda: _heartbeats(api, killed_id) >= 1, limit=60)
        wait_for("Running", lambda: _state(api, killed_id) == "RUNNING", limit=30)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        seconds = wait_for(
            "Crashed", lambda: _state(api, killed_id) == "CRASHED", limit=CRASHED_WITHIN, every=2
        )
        print(f"\nkilled flow run shown as Crashed {seconds:.0f} s after SIGKILL")
        assert "No heartbeat for 90 s" in _get(f"{api}/flow_runs/{killed_id}", timeout=30)["state"]["message"]
        assert finished.wait(timeout=120) == 0
        wait_for("Completed", lambda: _state(api, finished_id) == "COMPLETED", limit=30)
        time.sleep(max(0.0, 95 - seconds))  # give the automation its 90 s to misfire on the completed run
        wait_for("Completed", lambda: _state(api, finished_id) == "COMPLETED", limit=30)
    finally:
        for proc in (killed, finished):
            _stop_group(proc)


# ------------------------------------------------------- a deployed run killed, Crashed, retried

# The fault tests' small job (the demo's model), on 2 slots, long enough to be killed mid-run, a
# checkpoint every step, no scenario.
TINY_PPO = copy.deepcopy(FAULT_JOB) | {"name": "deployed"}
TINY_PPO["cluster"]["devices"] = 2
TINY_PPO["job"].update(steps=20, snapshot_every=1, adapt=False, scenario=[])


def _prefect(env: dict[str, str], cwd: Path, *args: str, timeout: float = 180) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def _checkpoint_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "state" / "checkpoints"
    return sorted(int(p.stem.split("=")[1]) for p in folder.glob("step=*.json")) if folder.is_dir() else []


def _flow_run_process(worker: subprocess.Popen, run_id: str) -> psutil.Process | None:
    """The worker's child that runs the flow run ``run_id`` (its Dask workers inherit the same
    PREFECT__FLOW_RUN_ID; the flow run's own process is the topmost of them)."""
    ours = []
    for proc in psutil.Process(worker.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("PREFECT__FLOW_RUN_ID") == run_id:
                ours.append(proc)
    pids = {proc.pid for proc in ours}
    top = [proc for proc in ours if proc.ppid() not in pids]
    return top[0] if len(top) == 1 else None


@pytest.mark.slow  # 2 to 4 minutes on a loaded 2-core machine
def test_a_retry_of_a_crashed_deployed_run_resumes_its_run_directory(
    server: dict[str, str], tmp_path: Path
) -> None:
    """The README's steps with prefect.yaml's ``ppo-demo`` deployment: a work pool, ``prefect
    deploy``, a worker, ``prefect deployment run`` with a small config (a checkpoint every step).
    The flow run's process is killed with SIGKILL after its first checkpoint: the run becomes
    Crashed; ``prefect flow-run retry`` (what the UI's Retry does: the same flow run set to
    Scheduled) runs it again, and it resumes its own run directory and completes."""
    api = server["PREFECT_API_URL"]
    project = tmp_path / "project"  # a checkout's packages: prefect deploy's working directory
    project.mkdir()
    for package in ("flows", "nereus_core", "storage", "tasks"):
        (project / package).symlink_to(ROOT / package, target_is_directory=True)
    (project / "prefect.yaml").write_text((ROOT / "prefect.yaml").read_text())
    (project / "tiny.yaml").write_text(json.dumps(TINY_PPO))  # YAML is a superset of JSON
    # no PREFECT_FLOWS_HEARTBEAT_FREQUENCY here: the heartbeats come from the deployment's setting
    env = server | {"PYTHONPATH": str(ROOT), "NEREUS_CACHE_DIR": str(tmp_path / "cache")}
    _prefect(env, project, "work-pool", "create", "nereus-local", "--type", "process")
    _prefect(env, project, "deploy", "--name", "ppo-demo", "--no-prompt")
    worker_log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", "nereus-local"],
        cwd=project,
        env=env,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out = _prefect(
            env, project, "deployment", "run", "nereus-ppo/ppo-demo", "--param", "config=tiny.yaml"
        )
        run_id = next(line.split()[-1] for line in out.splitlines() if "UUID:" in line)
        runs = project / "runs"
        run_dir = runs / f"{TINY_PPO['name']}-{run_id[:8]}"

        def checkpointed() -> bool:
            assert worker.poll() is None, "the worker ended"
            return bool(_checkpoint_steps(run_dir)) and _checkpoint_steps(run_dir)[-1] >= 1

        wait_for("a checkpoint at step >= 1", checkpointed, limit=420)
        wait_for("a heartbeat of the deployed run", lambda: _heartbeats(api, run_id) >= 1, limit=60)
        engine = _flow_run_process(worker, run_id)
        assert engine is not None, "no process of the worker runs the flow run"
        family = [engine, *engine.children(recursive=True)]
        engine.kill()
        killed = time.monotonic()
        killed_at = _checkpoint_steps(run_dir)[-1]
        assert killed_at < TINY_PPO["job"]["steps"], "the run had finished before it was killed"
        crashed_s = wait_for(
            "Crashed", lambda: _state(api, run_id) == "CRASHED", limit=CRASHED_WITHIN, every=0.5
        )
        message = _get(f"{api}/flow_runs/{run_id}", timeout=30)["state"]["message"] or ""
        by = "the automation" if "No heartbeat" in message else "the worker"
        print(
            f"\ndeployed flow run shown as Crashed {crashed_s:.1f} s after SIGKILL, by {by}: {message[:80]}"
        )
        assert "SIGKILL" in message or "No heartbeat" in message, message
        wait_for("the killed run's Dask workers to end", lambda: not any(map(running, family)), limit=60)
        assert not (run_dir / "summary.json").exists()
        # A retry must wait for the worker to be done with the killed run: the worker reports the
        # crash once more when its on_crashed hooks have run, and that report would turn a retry
        # (Scheduled) made before it back into Crashed.
        wait_for(
            "the worker to be done with the killed run",
            lambda: _heartbeats(api, run_id, "prefect.worker.executed-flow-run") >= 1,
            limit=120,
        )
        print(f"the worker was done with it {time.monotonic() - killed:.1f} s after SIGKILL")
        assert "failed to retrieve flow" not in (tmp_path / "worker.log").read_text()  # hooks loaded it
        assert _state(api, run_id) == "CRASHED"

        retried = time.monotonic()
        _prefect(env, project, "flow-run", "retry", run_id)
        wait_for(
            "the retry to end",
            lambda: _state(api, run_id) in ("COMPLETED", "FAILED", "CRASHED"),
            limit=600,
            every=1,
        )
        completed_s = time.monotonic() - retried
        assert _state(api, run_id) == "COMPLETED", (tmp_path / "worker.log").read_text()[-3000:]
        print(f"retry of the crashed run completed {completed_s:.0f} s after `prefect flow-run retry`")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed"
        assert summary["steps"] == TINY_PPO["job"]["steps"]
        assert summary["resumed_from_step"] >= max(1, killed_at), (summary["resumed_from_step"], killed_at)
        assert [p.name for p in runs.iterdir()] == [run_dir.name], "the retry wrote another run directory"
        record = _get(f"{api}/flow_runs/{run_id}", timeout=30)
        assert record["run_count"] >= 2, record["run_count"]  # the same flow run, run a second time
    finally:
        _stop_group(worker)
        worker_log.close()
