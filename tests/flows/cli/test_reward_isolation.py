"""The real ``nereus plan`` and ``nereus run`` against a reward file that exits, sleeps for ever or
allocates 50 GB when it is imported: each is refused in one line (exit status 2, no traceback) within
seconds, naming the worker's log, because the file is imported in a worker process and never in the
driver; no process of the command's session is left, no run directory made."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import hostile_inputs
from tests.support.processes import session_left, wait_for

ROOT = Path(__file__).resolve().parents[3]
SECONDS = 45.0  # start to exit, the CLI's own start included (8-13 s on a busy 2-core host, 19 s sleeping)
LOAD_S = 5  # reward.load_timeout_s for the file that sleeps

AT_IMPORT = {
    "exits": ("import os\nos._exit(3)\n", "its worker ended while loading it (exit status 3)"),
    "sleeps": ("import time\ntime.sleep(10**6)\n", f"did not finish within reward.load_timeout_s={LOAD_S} s"),
    "allocates": ("x = bytearray(50 * 2**30)\n", "raised MemoryError: (no message); the worker's address"),
}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config that works (a tiny Llama, its tokenizer, JSONL data, gsm8k) and the hostile files."""
    root = tmp_path_factory.mktemp("reward-isolation")
    for name, (code, _) in AT_IMPORT.items():
        (root / f"{name}.py").write_text(code + "def score(a, b, c, d):\n    return 0.0\n")
    return hostile_inputs.base(root)


def _kill_session(session: int) -> None:
    for pid in session_left(session):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("name", list(AT_IMPORT))
def test_a_reward_file_that_exits_hangs_or_allocates_at_import_is_one_line(
    config: Path, tmp_path: Path, command: str, name: str
) -> None:
    spec = f"{config.parent / name}.py:score"
    sets = ["--set", f"reward.function={spec}"]
    sets += ["--set", f"reward.load_timeout_s={LOAD_S}"] if name == "sleeps" else []  # others: 60 s
    argv = [command, str(config), *sets, *(["--out", "out"] if command == "run" else [])]
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli.main", *argv],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:  # the driver hangs with the file: end all of it, then fail
        _kill_session(proc.pid)
        proc.communicate()
        pytest.fail(f"nereus {command} did not end within 90 s with {name}.py")
    elapsed = time.perf_counter() - started
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and out == "", err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nereus: error: {config}: reward.function: "), err
    assert AT_IMPORT[name][1] in lines[0], lines[0]
    log = Path(lines[0].rpartition("(worker log: ")[2].removesuffix(")"))
    assert log.is_file(), lines[0]  # the worker's output, kept for the user to read
    if name == "allocates":
        assert "reward.max_memory=4GiB" in lines[0] and "MemoryError" in log.read_text()
    log.unlink()
    assert elapsed < SECONDS, elapsed
    wait_for("the reward worker's end", lambda: not session_left(proc.pid), 10, every=0.2)
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
