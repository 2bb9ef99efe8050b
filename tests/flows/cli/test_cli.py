"""flows.cli.main: bad input ends with one line on stderr and exit status 2; good input reaches the flow.

The flows themselves are replaced by fake ``flows.job.rl_job`` / ``flows.selfcheck`` modules: these tests need
neither Prefect nor Dask.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

from flows.cli import watchdog as cli_watchdog
from flows.cli.main import SCHEDULER_ENV, build_parser, main
from nereus_core.config import NereusConfig

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny_ppo.yaml"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, Any]]:
    """Record the calls of fake ``ppo_job`` and ``selfcheck_flow`` flows; run in an empty directory."""
    recorded: list[dict[str, Any]] = []
    for module, name in (("flows.job.rl_job", "ppo_job"), ("flows.selfcheck", "selfcheck_flow")):
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
        [sys.executable, "-m", "flows.cli.main", "run", path],
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


# ---------------------------------------------------------------- help, pipes and the Prefect API


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_lists_every_command_on_one_line_each() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli.main", "--help"],
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
            f"'{sys.executable}' -m flows.cli.main plan '{EXAMPLE}' | head -1; exit ${{PIPESTATUS[0]}}",
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
        [sys.executable, "-m", "flows.cli.main", *argv],
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
