"""flows.cli: bad input ends with one line on stderr and exit status 2; good input reaches the flow.

The flows themselves are replaced by fake ``flows.ppo_job`` / ``flows.selfcheck`` modules: these tests need
neither Prefect nor Dask.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from flows import cli_watchdog
from flows.cli import MAX_DEVICES_ENV, SCHEDULER_ENV, build_parser, main
from nereus_core.config import NereusConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_ppo.yaml"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, Any]]:
    """Record the calls of fake ``ppo_job`` and ``selfcheck_flow`` flows; run in an empty directory."""
    recorded: list[dict[str, Any]] = []
    for module, name in (("flows.ppo_job", "ppo_job"), ("flows.selfcheck", "selfcheck_flow")):
        fake = types.ModuleType(module)
        setattr(fake, name, lambda **kwargs: recorded.append(kwargs))
        monkeypatch.setitem(sys.modules, module, fake)
    monkeypatch.delenv(SCHEDULER_ENV, raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    # the fake flows start no Prefect server, so there is nothing for a watchdog to stop
    monkeypatch.setattr(cli_watchdog, "start_watchdog", lambda pid=None: None)
    monkeypatch.chdir(tmp_path)
    return recorded


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def assert_one_line_error(capsys: pytest.CaptureFixture[str], code: int, *needles: str) -> str:
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("nereus: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_run_passes_the_validated_config_to_the_flow(calls: list[dict[str, Any]], capsys) -> None:
    assert main(["run", str(EXAMPLE)]) == 0
    [call] = calls
    cfg = call["config"]
    assert isinstance(cfg, NereusConfig)
    assert cfg.name == "tiny-ppo" and cfg.job.steps == 40 and cfg.cluster.scheduler_address is None
    out_dir = Path(call["out_dir"])
    assert out_dir.parent == Path("runs") and out_dir.name.startswith("tiny-ppo-")
    assert str(out_dir) in capsys.readouterr().out


def test_run_applies_steps_out_and_typed_sets(calls: list[dict[str, Any]], tmp_path: Path) -> None:
    argv = ["run", str(EXAMPLE), "--steps", "2", "--out", str(tmp_path / "r")]
    argv += ["--set", "job.lr=0.5", "--set", "name=other", "--set", "cluster.memory_per_device=1GiB"]
    argv += ["--set", "cluster.devices=4", "--set", "plan.reward/infer.devices=[3, 2]"]
    argv += ["--set", "model.tie_word_embeddings=false"]
    assert main(argv) == 0
    cfg = calls[0]["config"]
    assert cfg.job.steps == 2 and cfg.job.lr == 0.5 and cfg.name == "other"
    assert cfg.cluster.memory_per_device == 1024**3
    assert cfg.plan["reward/infer"].devices == (3, 2)
    assert calls[0]["out_dir"] == str(tmp_path / "r")


def test_later_sets_replace_earlier_ones(calls: list[dict[str, Any]]) -> None:
    sets = ["--set", "job=3", "--set", "job.steps=2", "--set", "job.batch_size=16", "--set", "job.steps=1"]
    assert main(["run", str(EXAMPLE), *sets]) == 0
    job = calls[0]["config"].job
    assert (job.steps, job.batch_size) == (1, 16)


def test_steps_flag_wins_over_set(calls: list[dict[str, Any]]) -> None:
    assert main(["run", str(EXAMPLE), "--set", "job.steps=3", "--steps", "1"]) == 0
    assert calls[0]["config"].job.steps == 1


def test_scheduler_address_from_the_environment(calls: list[dict[str, Any]], monkeypatch) -> None:
    monkeypatch.setenv(SCHEDULER_ENV, "tcp://10.0.0.5:8786")
    assert main(["run", str(EXAMPLE)]) == 0
    assert calls[0]["config"].cluster.scheduler_address == "tcp://10.0.0.5:8786"
    assert main(["run", str(EXAMPLE), "--set", "cluster.scheduler_address=tcp://h:1"]) == 0
    assert calls[1]["config"].cluster.scheduler_address == "tcp://h:1"


def test_empty_file_takes_the_defaults(calls: list[dict[str, Any]], tmp_path: Path) -> None:
    assert main(["run", write(tmp_path, "")]) == 0
    assert calls[0]["config"] == NereusConfig()


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("job: {steps: 0}\n", ("cfg.yaml: job.steps=0",)),
        ("job:\n  stepz: 3\n", ("job.stepz: unknown field",)),
        ("plan:\n  actor/trian: {tp: 1, devices: [0]}\n", ("plan.actor/trian: unknown model-stage",)),
        ("model:\n  hidden_size: 66\n", ("model.hidden_size=66",)),
        ("cluster: {memory_per_device: lots}\n", ("cluster.memory_per_device",)),
        ("job: {steps: 2\n", ("not valid YAML at line",)),
        ("key: [unclosed\n", ("not valid YAML",)),
        ("- a\n- b\n", ("must be a mapping of sections", "got a list")),
        ("just a string\n", ("got a string",)),
    ],
)
def test_bad_config_file(calls, tmp_path: Path, capsys, text: str, needles: tuple[str, ...]) -> None:
    path = write(tmp_path, text)
    line = assert_one_line_error(capsys, main(["run", path]), f"nereus: error: {path}: ", *needles)
    assert calls == [], line


def test_missing_file(calls, capsys) -> None:
    assert_one_line_error(capsys, main(["run", "nope.yaml"]), "nereus: error: nope.yaml: no such file")


def test_directory_instead_of_file(calls, tmp_path: Path, capsys) -> None:
    assert_one_line_error(capsys, main(["run", str(tmp_path)]), "is a directory")


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--set", "job.steps"], ("--set 'job.steps': expected key=value",)),
        (["--set", "job..steps=2"], ("empty part",)),
        (["--set", "job.steps=[1"], ("the value is not valid YAML",)),
        (["--set", "job.steps=0"], ("job.steps=0: must be >= 1",)),
        (["--set", "job.stepz=2"], ("job.stepz: unknown field",)),
        (["--set", "cluster.devices=1"], ("exceeds cluster.devices=1",)),
        (["--steps", "0"], ("job.steps=0",)),
        (["--steps", "two"], ("argument --steps: invalid int value: 'two'",)),
        (["--bogus"], ("unrecognized arguments: --bogus",)),
    ],
)
def test_bad_overrides(calls, capsys, extra: list[str], needles: tuple[str, ...]) -> None:
    assert_one_line_error(capsys, main(["run", str(EXAMPLE), *extra]), *needles)
    assert calls == []


def test_resume_of_a_missing_run_fails_with_one_line(calls, capsys, tmp_path) -> None:
    missing = tmp_path / "nope"
    assert_one_line_error(capsys, main(["resume", str(missing)]), "not a run directory")
    assert_one_line_error(capsys, main(["resume", str(missing), "--devices", "0"]), "not a run directory")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text("name: fresh\n")
    assert_one_line_error(capsys, main(["resume", str(fresh)]), "no checkpoint to resume from")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", "cfg.yaml"], "cfg.yaml: no such file"),
        (["report", "runs/x"], "runs/x has no summary.json"),
        (["export", "runs/x", "--model", "actor", "--hf", "out"], "runs/x is not a run directory"),
    ],
)
def test_commands_on_missing_inputs_fail_with_one_line(calls, capsys, argv: list[str], expected: str) -> None:
    assert_one_line_error(capsys, main(argv), expected)


def test_no_command_prints_help(capsys) -> None:
    assert main([]) == 2
    assert "run" in capsys.readouterr().err


def test_version(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("nereus ")


def test_bad_config_in_a_subprocess(tmp_path: Path) -> None:
    path = write(
        tmp_path, "cluster:\n  devices: 2\nplan:\n  actor/train: {tp: 2, dp: 2, devices: [0, 1, 2, 3]}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != SCHEDULER_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", path],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"nereus: error: {path}: plan.actor/train: tp*pp*dp=4 exceeds cluster.devices=2; "
        "lower a degree or add devices"
    ]
    assert done.stdout == ""


# ----------------------------------------------------------------- hostile input, in a subprocess
# Each case runs the real CLI (no fake flows) with Prefect, Dask and distributed made unimportable:
# it must end in one line on stderr with exit 2, no traceback, within seconds of CPU time, without
# starting any of them, and leave no run directory.

SECONDS = 8.0  # CPU seconds of the CLI process; its start (torch and pydantic imports) takes about 1.5
WALL_SECONDS = 60.0  # wall-clock, loose for a loaded machine; a Prefect server alone took ~70 s
NOT_BEFORE_REFUSAL = ("prefect", "dask", "distributed")


@pytest.fixture(scope="module")
def blocked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that shadows the packages a refusal must not reach: importing one fails loudly."""
    root = tmp_path_factory.mktemp("blocked")
    for name in NOT_BEFORE_REFUSAL:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(f"raise ImportError('{name} imported before the refusal')\n")
    return root


def cli(cwd: Path, *argv: str, blocked: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the CLI with ``blocked`` first on its path; its result and the CPU seconds it used (after
    checking its wall-clock time)."""
    full_env = {k: v for k, v in os.environ.items() if k not in (SCHEDULER_ENV, MAX_DEVICES_ENV)}
    full_env["PYTHONPATH"] = os.pathsep.join([str(blocked), str(ROOT)])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", *argv],
        cwd=cwd,
        env=full_env | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.perf_counter() - started < WALL_SECONDS, done
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # this child only: pytest runs one at a time
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def assert_refused(done: subprocess.CompletedProcess[str], seconds: float, *needles: str) -> str:
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("nereus: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert seconds < SECONDS, (seconds, lines[0])
    return lines[0]


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def alias_bomb() -> str:
    """About 400 bytes that expand to 9**9 values (the "billion laughs"), the last level as the run's
    name so that validating or showing it would walk every value."""
    names = "abcdefghi"
    lines = [f"{names[0]}: &{names[0]} [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in itertools.pairwise(names)]
    return "\n".join([*lines, "name: *i"]) + "\n"


EX = str(EXAMPLE)
BOMB_FLOW = "{" + alias_bomb().strip().replace("\n", ", ") + "}"

RUN_CASES = {
    "bomb-file": (["run", "bomb.yaml"], "bomb.yaml: refused: expands to more than 100,000 values"),
    "bomb-plan": (["plan", "bomb.yaml"], "refused: expands to more than 100,000 values"),
    "bomb-set": (
        ["run", EX, "--out", "out", "--set", f"job.scenario={BOMB_FLOW}"],
        "the value is refused: expands",
    ),
    "batch-trillion": (
        ["run", EX, "--out", "out", "--set", "job.batch_size=1000000000000"],
        "in the driver, more than",
    ),
    "one-byte-slots": (
        ["run", EX, "--out", "out", "--set", "cluster.memory_per_device=1", "--set", "job.adapt=false"],
        "cluster.memory_per_device=1 B: the initial plan",
    ),
    "devices-4096": (
        ["run", EX, "--out", "out", "--set", "cluster.devices=4096"],
        "cluster.devices=4096 exceeds the",
    ),
    "name-absolute": (["run", EX, "--set", "name=/etc/x"], "name='/etc/x': a run name is"),
    "name-parent": (["run", EX, "--set", "name=../../x"], "name='../../x': a run name is"),
    "name-long": (["run", EX, "--set", f"name={'n' * 101}"], "a run name is 1-100 letters"),
}


@pytest.mark.parametrize(("argv", "needle"), list(RUN_CASES.values()), ids=list(RUN_CASES))
def test_hostile_run_input_is_refused_before_anything_starts(
    tmp_path: Path, argv: list[str], needle: str
) -> None:
    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    before = files_under(tmp_path)
    assert_refused(*cli(tmp_path, *argv, blocked=blocked), needle)
    assert files_under(tmp_path) == before  # neither runs/ nor the --out directory


def peak_rss(cwd: Path, *argv: str) -> tuple[int, int]:
    """Exit status and peak RSS in bytes of the whole CLI process (``wait4``'s ``ru_maxrss``)."""
    env = {k: v for k, v in os.environ.items() if k != SCHEDULER_ENV} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *argv], cwd=cwd, env=env, stderr=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024


def test_the_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """Unbounded, this bomb grew past 2.4 GB; refused, it costs what any one-line error costs (the
    CLI's imports: torch, pydantic), measured the same way on a plain bad config."""
    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    (tmp_path / "plain.yaml").write_text("job: {steps: 0}\n")
    code, bomb = peak_rss(tmp_path, "plan", "bomb.yaml")
    plain_code, plain = peak_rss(tmp_path, "plan", "plain.yaml")
    assert (code, plain_code) == (2, 2)
    assert bomb < plain + 32 * 2**20, f"bomb {bomb / 2**20:.0f} MiB vs a plain error {plain / 2**20:.0f} MiB"
    # Far below the 2.4 GB the unbounded bomb reached; the CLI's own imports vary (a first import that
    # compiles bytecode costs more), so the absolute bound is loose and the relative one above is tight.
    assert bomb < 1024 * 2**20, f"peak RSS {bomb / 2**20:.0f} MiB"


def make_run(root: Path, *, steps: tuple[int, ...] = (2,), summary: dict[str, Any] | None = None) -> Path:
    """A run directory of the demo config with checkpoint records at ``steps`` (no snapshots)."""
    from storage.run_dir import RunDir

    cfg = NereusConfig.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    run = RunDir.create(root, cfg.model_dump(mode="json"))
    plan = {k: v.model_dump(mode="json") for k, v in cfg.plan.items()}
    for step in steps:
        run.write_checkpoint(step, {"plan_id": "p", "plan": plan, "devices": 2, "response_len": 6})
    if summary is not None:
        run.write_summary(summary)
    return root


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _drop_plan(path: Path) -> None:
    record = json.loads(path.read_text())
    del record["plan"]
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("damage", "needle"),
    [(_truncate, "step=2.json"), (_drop_plan, "step=2.json")],
    ids=["truncated-checkpoint", "edited-checkpoint"],
)
def test_resume_on_a_damaged_checkpoint_is_one_line(
    tmp_path: Path, blocked: Path, damage: Any, needle: str
) -> None:
    run = make_run(tmp_path / "run")
    damage(run / "state" / "checkpoints" / "step=2.json")
    before = files_under(run)
    line = assert_refused(*cli(tmp_path, "resume", str(run), blocked=blocked), needle)
    assert line.count(str(run)) == 1, line  # the damaged file named once, not after its run too
    assert files_under(run) == before


def test_resume_of_a_completed_run_is_refused_before_any_server_starts(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", summary={"status": "completed", "steps": 40})
    before = files_under(run)
    assert_refused(
        *cli(tmp_path, "resume", str(run), blocked=blocked), "holds a completed run, nothing to resume"
    )
    assert files_under(run) == before


@pytest.mark.parametrize(
    ("devices", "env", "needle"),
    [
        ("0", {}, "--devices 0: give at least 1"),
        ("-3", {}, "--devices -3: give at least 1"),
        ("9", {MAX_DEVICES_ENV: "8"}, "--devices 9 exceeds the 8 device slots"),
        ("100000", {}, "--devices 100000 exceeds the"),
        ("2", {MAX_DEVICES_ENV: "lots"}, f"{MAX_DEVICES_ENV}='lots': give a whole number"),
    ],
)
def test_resume_devices_are_bounded_like_run(
    tmp_path: Path, blocked: Path, devices: str, env: dict[str, str], needle: str
) -> None:
    run = make_run(tmp_path / "run")
    before = files_under(run)
    assert_refused(*cli(tmp_path, "resume", str(run), "--devices", devices, blocked=blocked, **env), needle)
    assert files_under(run) == before


@pytest.mark.parametrize("command", ["run", "resume"])
def test_a_second_driver_on_a_locked_run_is_refused(tmp_path: Path, blocked: Path, command: str) -> None:
    from storage.lock import run_lock

    run = make_run(tmp_path / "run")
    with run_lock(run):
        before = files_under(run)  # the holder's .lock included
        argv = ["run", str(EXAMPLE), "--out", str(run)] if command == "run" else ["resume", str(run)]
        line = assert_refused(*cli(tmp_path, *argv, blocked=blocked), f"in use by pid {os.getpid()}")
    assert ("choose another --out" in line) == (command == "run")
    assert files_under(run) == before


def test_report_on_a_truncated_summary_is_one_line(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", summary={"status": "completed", "history": []})
    _truncate(run / "summary.json")
    assert_refused(*cli(tmp_path, "report", str(run), blocked=blocked), "summary.json")
    assert not (run / "plots").exists()


def test_export_of_a_step_without_a_snapshot_lists_the_committed_steps(tmp_path: Path) -> None:
    from nereus_core.emu import Box, SliceSpec
    from storage import write_snapshot

    run = make_run(tmp_path / "run")
    for step in (0, 4):
        write_snapshot(
            run, "actor", step, {0: {"w": (torch.zeros(2, 3), SliceSpec((2, 3), Box((0, 0), (2, 3))))}}
        )
    argv = ["export", str(run), "--model", "actor", "--step", "7", "--hf", str(tmp_path / "hf")]
    line = assert_refused(*cli(tmp_path, *argv, blocked=blocked), "actor", "step 7", "committed steps")
    assert re.search(r"committed steps: \[?0, 4\]?$", line), line
    assert not (tmp_path / "hf").exists()


def test_the_blocked_packages_cannot_be_imported(blocked: Path) -> None:
    """The refusal tests prove that nothing started only if the blocker works."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(blocked), str(ROOT)])}
    for name in NOT_BEFORE_REFUSAL:
        done = subprocess.run(
            [sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True
        )
        assert done.returncode != 0 and f"{name} imported before the refusal" in done.stderr


# ---------------------------------------------------------------- help, pipes and the Prefect API


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_lists_every_command_on_one_line_each() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "--help"],
        cwd=ROOT,
        env=os.environ | {"COLUMNS": "80"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done
    lines = done.stdout.splitlines()
    commands = _commands(build_parser())
    assert set(commands) >= {"run", "resume", "plan", "selfcheck", "simulate", "report", "export"}
    for name in commands:
        (line,) = [line for line in lines if line.split()[:1] == [name]]
        assert len(line.split()) > 2, f"{name} has no help on its line: {line!r}"
        after = (lines[lines.index(line) + 1 :] or [""])[0].split()
        assert not after or after[0] in commands, f"{name}'s help wraps onto the next line: {after}"
        assert len(line) <= 80, line


def test_every_option_of_every_command_is_described() -> None:
    for name, parser in _commands(build_parser()).items():
        for action in parser._actions:
            assert action.help, f"nereus {name}: {action.option_strings or action.metavar} has no help"


def test_export_help_describes_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--help"]) == 0
    out = capsys.readouterr().out
    for option, words in (
        ("DIR", "the run to export from"),
        ("--model", "which model"),
        ("--step", "committed step"),
        ("--hf", "folder to write"),
    ):
        assert option in out and words in out, out


def test_plan_into_a_closed_pipe_exits_quietly() -> None:
    done = subprocess.run(
        [
            "bash",
            "-c",
            f"'{sys.executable}' -m flows.cli plan '{EXAMPLE}' | head -1; exit ${{PIPESTATUS[0]}}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.startswith("nereus plan: tiny-ppo"), done
    assert len(done.stdout.splitlines()) == 1
    assert done.stderr == "", done.stderr  # no BrokenPipeError, no "Exception ignored"
    assert done.returncode in (0, 141), done  # 141: the reader left before the last line


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # free once the socket closes: nothing listens there


def _run_against(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "NEREUS_"))}
    full |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONPATH": str(ROOT)} | env
    argv = ["run", str(EXAMPLE), "--out", str(tmp_path / "run")]
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *argv],
        cwd=tmp_path,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_unreachable_api_url_in_the_environment_is_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/api"
    done = _run_against(tmp_path, {"PREFECT_API_URL": url})
    assert done.returncode == 2, done
    assert done.stdout == "" and "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"nereus: error: the Prefect API at {url} (PREFECT_API_URL in the environment)")
    assert "'prefect server start'" in line and "unset PREFECT_API_URL" in line, line
    assert not (tmp_path / "run").exists()


def test_an_unreachable_api_url_of_a_profile_says_how_to_go_back(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/api"
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "profiles.toml").write_text(
        f'active = "nereus-server"\n\n[profiles.nereus-server]\nPREFECT_API_URL = "{url}"\n'
    )
    done = _run_against(tmp_path, {})
    assert done.returncode == 2, done
    (line,) = done.stderr.splitlines()
    assert f"{url} (PREFECT_API_URL of Prefect profile 'nereus-server')" in line, line
    assert "'prefect server start'" in line and "'prefect profile use ephemeral'" in line, line


def test_an_api_that_never_answers_is_one_line_within_seconds(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel does) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/api"
        started = time.perf_counter()
        done = _run_against(tmp_path, {"PREFECT_API_URL": url})
        seconds = time.perf_counter() - started
    assert done.returncode == 2, done
    (line,) = done.stderr.splitlines()
    assert "does not answer (no answer within 2 s)" in line or "timed out" in line, line
    assert seconds < 60, seconds
