"""nereus_core/rewards/isolation.py and the worker's side of it: a user's reward file is checked at
config load by a worker process, never imported in the driver (a file that exits, hangs or allocates
without bound at import is one line, the driver unharmed); the worker sees only the environment the
config gives it, runs under its memory and CPU limits, and writes what it prints to a log file that
every error line names."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from nereus_core.config.data import RewardConfig
from nereus_core.rewards import RewardError, registry, worker, worker_process
from nereus_core.rewards.isolation import BASE_ENV, WorkerSettings
from tests.support.processes import running, wait_for

ROOT = Path(__file__).resolve().parents[3]

# Each runs when the file is imported.
AT_IMPORT = {
    "exits": ("import os\nos._exit(3)\n", "its worker ended while loading it (exit status 3)"),
    "sleeps": ("import time\ntime.sleep(10**6)\n", "did not finish within reward.load_timeout_s=3 s"),
    "allocates": (
        "x = bytearray(50 * 2**30)\n",
        "raised MemoryError: (no message); the worker's address space is limited to reward.max_memory=4GiB",
    ),
}
SCORE = "def score(a, b, c, d):\n    return 1.0\n"
ENV = (
    "import os\ndef score(a, b, c, d):\n    print('seen:', sorted(os.environ))\n    return dict(os.environ)\n"
)
LIMITS = (
    "import os, resource, time\n"
    "def score(a, b, c, d):\n"
    "    if b == 'spin':\n"
    "        end = time.process_time() + float(c)\n"
    "        while time.process_time() < end:\n"
    "            pass\n"
    "    if b == 'alloc':\n"
    "        return len(bytearray(int(c)))\n"
    "    if b == 'print':\n"
    "        print('z' * int(c))\n"
    "    limits = resource.getrlimit(resource.RLIMIT_AS) + resource.getrlimit(resource.RLIMIT_CPU)\n"
    "    return [os.getpid(), *limits]\n"
)


def _spec(tmp_path: Path, name: str, code: str) -> str:
    (tmp_path / f"{name}.py").write_text(code)
    return f"{tmp_path / name}.py:score"


def _log_of(line: str) -> Path:
    return Path(line.rpartition("(worker log: ")[2].partition(")")[0])


@pytest.mark.parametrize("name", list(AT_IMPORT))
def test_a_file_that_exits_hangs_or_allocates_at_import_is_refused_at_config_load(
    tmp_path: Path, name: str
) -> None:
    code, needle = AT_IMPORT[name]
    spec = _spec(tmp_path, name, code + SCORE)
    started = time.perf_counter()
    with pytest.raises(ValidationError) as err:  # a deadline only the one that sleeps reaches
        RewardConfig(function=spec, load_timeout_s=3 if name == "sleeps" else 60)
    elapsed = time.perf_counter() - started
    line = err.value.errors()[0]["msg"].removeprefix("Value error, ")
    assert line.startswith("reward.function: ") and needle in line and "\n" not in line, line
    assert elapsed < 20, elapsed  # the deadline is 3 s; the others end in a fraction of a second
    log = _log_of(line)
    assert log.is_file()  # the log the line names is there to read
    if name == "allocates":
        assert "MemoryError" in log.read_text()  # with the import's traceback
    log.unlink()


def test_the_form_and_path_are_checked_without_running_the_file(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "marks", "open(__file__ + '.ran', 'w').close()\n" + SCORE)
    with pytest.raises(ValidationError, match="does not exist"):
        RewardConfig(function=f"{tmp_path}/none.py:score")
    with pytest.raises(ValidationError, match="not a Python function name"):
        RewardConfig(function=spec.replace(":score", ":1x"))
    assert not (tmp_path / "marks.py.ran").exists()  # refused before anything ran
    reward = registry.resolve(spec)  # a worker is made, not started: nothing has run yet
    assert not (tmp_path / "marks.py.ran").exists()
    assert reward.fn("s", "a", "b", {}) == 1.0 and (tmp_path / "marks.py.ran").exists()
    reward.fn.close()


def test_the_worker_sees_only_the_environment_the_config_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET_X", "driver-only")
    monkeypatch.setenv("PASSED_Y", "passed")
    monkeypatch.setenv("WANDB_API_KEY", "token")
    spec = _spec(tmp_path, "env", ENV)
    log = tmp_path / "run" / "logs" / "reward_worker.log"
    config = RewardConfig(function=spec, env={"SET_Z": "set"}, pass_env=("PASSED_Y", "NOT_SET_W"))
    reward = config.resolve(str(log))
    seen = reward.fn("s", "a", "b", {})
    assert "SECRET_X" not in seen and "WANDB_API_KEY" not in seen
    assert seen["PASSED_Y"] == "passed" and seen["SET_Z"] == "set" and "NOT_SET_W" not in seen
    # Python itself may add LC_CTYPE (PEP 538); nothing else beyond what was named.
    assert set(seen) <= {*BASE_ENV, "PASSED_Y", "SET_Z"}, sorted(seen)
    assert seen.get("PATH") == os.environ.get("PATH")
    reward.fn.close()
    printed = log.read_text()  # what it printed is in the log it was given
    assert printed.startswith("seen: [") and "'PASSED_Y'" in printed and "SECRET_X" not in printed
    bare = RewardConfig(function=spec).resolve()
    assert "PASSED_Y" not in bare.fn("s", "a", "b", {})
    bare.fn.close()
    with pytest.raises(ValidationError, match="is not an environment variable name"):
        RewardConfig(function=spec, pass_env=("A=B",))


def test_the_worker_runs_under_its_limits_and_is_replaced_before_its_cpu_limit(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "limits", LIMITS)
    settings = WorkerSettings(timeout_s=30, max_memory=512 * 2**20, max_cpu_s=2)
    reward = registry.resolve(spec, settings)
    pid, *limits = reward.fn("s", "", "", {})
    assert limits == [512 * 2**20, 512 * 2**20, 2, 2 + 5]  # hard limits too: the user's code cannot lift them
    with pytest.raises(RewardError, match=r"raised MemoryError.*reward\.max_memory=512MiB.*\(worker log: "):
        reward.fn("s", "alloc", str(2**30), {})
    assert reward.fn("s", "", "", {})[0] == pid  # a MemoryError is the call's: the worker carries on
    assert reward.fn("s", "spin", "1.2", {})[0] == pid  # past half its CPU seconds: replaced after the call
    again = reward.fn("s", "", "", {})[0]
    assert again != pid
    with pytest.raises(RewardError, match=r"killed by SIGXCPU: past reward\.max_cpu_s=2 CPU seconds"):
        reward.fn("s", "spin", "30", {})  # one call past the limit: the kernel ends the worker
    assert reward.fn("s", "", "", {})[0] not in (pid, again)
    reward.fn.close()
    assert resource.getrlimit(resource.RLIMIT_AS)[0] != 512 * 2**20  # the driver's own are untouched


def test_the_log_is_bounded_per_call_and_rotated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker, "LOG_MAX_BYTES", 3 * worker_process.OUTPUT_CHARS)
    log = tmp_path / "logs" / "reward_worker.log"
    reward = registry.resolve(_spec(tmp_path, "loud", LIMITS), WorkerSettings(log_path=str(log)))
    started = time.perf_counter()
    pid = reward.fn("s", "print", str(50_000_000), {})[0]  # 50 MB printed, 1 MiB of it kept
    assert time.perf_counter() - started < 10
    text = log.read_text()
    assert len(text) < worker_process.OUTPUT_CHARS + 1000
    assert "48,951,425 more characters printed by the call were dropped" in text
    for _ in range(3):
        reward.fn("s", "print", str(worker_process.OUTPUT_CHARS), {})
    assert reward.fn("s", "", "", {})[0] != pid  # past LOG_MAX_BYTES: a new worker, a new log
    assert (tmp_path / "logs" / "reward_worker.log.1").stat().st_size > 3 * worker_process.OUTPUT_CHARS
    assert log.stat().st_size < 2 * worker_process.OUTPUT_CHARS
    reward.fn.close()


HANGS = (
    "import os, time\n"
    "def score(a, b, c, d):\n    open(c, 'w').write(str(os.getpid()))\n    time.sleep(10**6)\n"
)
DRIVER = (
    "import sys\nfrom nereus_core.rewards.worker import RewardWorker\n"
    "RewardWorker(sys.argv[1])('s', 'b', sys.argv[2], {})\n"
)


def test_a_worker_ends_with_its_driver_even_in_a_call_that_hangs(tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    spec = _spec(tmp_path, "hangs", HANGS)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, spec, str(pid_file)], cwd=ROOT)
    try:
        wait_for("the worker's call", lambda: pid_file.exists() and pid_file.read_text() != "", 60, every=0.2)
        worker_proc = psutil.Process(int(pid_file.read_text()))
    finally:
        driver.kill()  # no close, no EOF read by a worker stuck in the call
        driver.wait()
    try:
        wait_for("the orphaned worker's end", lambda: not running(worker_proc), 10, every=0.2)
    finally:
        if running(worker_proc):
            worker_proc.kill()
