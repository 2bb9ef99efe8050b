"""nereus_core/rewards/worker.py: a user's reward function in a worker process, against each way it
can misbehave (hang, exit, print megabytes, raise, return no finite score); the driver carries on
and the next call gets a fresh worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nereus_core.dataset.rows import Example
from nereus_core.prompt_source import score_row
from nereus_core.rewards import RewardError, registry
from nereus_core.rewards.isolation import WorkerSettings
from nereus_core.rewards.worker import RewardWorker
from tests.support.hostile_inputs import REWARDS

GOOD = "def score(a, b, c, d):\n    return 1.0 if b == c else 0.0\n"
PRINTS_THEN_SCORES = "def score(a, b, c, d):\n    print('x' * 20_000_000)\n    return 0.5\n"
EXAMPLE = Example(index=7, data_source="s", messages=({"role": "user", "content": "q"},), ground_truth="4")


def _reward(tmp_path: Path, name: str, code: str, timeout_s: float = 2.0) -> registry.RewardFn:
    (tmp_path / f"{name}.py").write_text(code)
    return registry.resolve(f"{tmp_path / name}.py:score", WorkerSettings(timeout_s=timeout_s))


EXPECTED = {
    "raises": "raised KeyError: 'no answer field'",
    "hangs": "did not return within reward.timeout_s=1 s",
    "nan": "returned float 'nan'",
    "inf": "returned float 'inf'",
    "string": "returned str 'correct'",
    "dict-no-score": "returned a dict without a 'score' key (keys: 'acc')",
    "prints-mb": "returned str 'nope'",
    "sys-exit": "tried to exit the process (SystemExit(3))",
    "os-exit": "ended its process (exit status 0)",
}


def test_each_misbehaviour_is_one_line_naming_function_and_row_and_the_worker_recovers(
    tmp_path: Path,
) -> None:
    for name, needle in EXPECTED.items():
        # 1 s for the one that hangs; the others answer at once, given time on a busy host
        reward = _reward(
            tmp_path, name.replace("-", "_"), REWARDS[name], timeout_s=1.0 if name == "hangs" else 20.0
        )
        started = time.perf_counter()
        with pytest.raises(RewardError) as err:
            score_row(reward, EXAMPLE, "4")
        message = str(err.value)
        assert needle in message and "\n" not in message, (name, message)
        assert message.startswith(f"reward function {tmp_path / name.replace('-', '_')}.py:score ")
        assert message.endswith("(on data row 7)"), message
        assert time.perf_counter() - started < 30, name
        assert isinstance(reward.fn, RewardWorker)
        reward.fn.close()


def test_a_worker_scores_prints_nothing_into_the_driver_and_restarts_after_a_hang(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    reward = _reward(tmp_path, "good", GOOD)
    assert score_row(reward, EXAMPLE, "4").score == 1.0
    assert score_row(reward, EXAMPLE, "5").score == 0.0
    loud = _reward(tmp_path, "loud", PRINTS_THEN_SCORES)
    assert score_row(loud, EXAMPLE, "4").score == 0.5
    assert capfd.readouterr().out == ""  # 20 MB printed in the worker, none of it here
    # Overhead of the round trip per response, on a warm worker.
    started = time.perf_counter()
    for _ in range(200):
        score_row(reward, EXAMPLE, "4")
    assert (time.perf_counter() - started) / 200 < 0.01
    hangs = _reward(
        tmp_path,
        "slow",
        "import time\ndef score(a, b, c, d):\n    time.sleep(float(b))\n    return 1.0\n",
        1.0,
    )
    with pytest.raises(RewardError, match="did not return within"):
        score_row(hangs, EXAMPLE, "30")
    assert score_row(hangs, EXAMPLE, "0").score == 1.0  # a fresh worker
    for fn in (reward.fn, loud.fn, hangs.fn):
        fn.close()


def test_builtins_stay_in_the_driver_and_an_import_that_exits_is_one_line(tmp_path: Path) -> None:
    assert registry.resolve("gsm8k", WorkerSettings()).fn is registry.TEXT_BUILTINS["gsm8k"]
    (tmp_path / "bye.py").write_text("import sys\nsys.exit(4)\ndef score(a, b, c, d):\n    return 0.0\n")
    spec = f"{tmp_path / 'bye.py'}:score"
    assert "bye.py raised SystemExit: 4" in (registry.load_problem(spec, WorkerSettings()) or "")
    reward = registry.resolve(spec)  # nothing imported here: the worker finds it at its start
    with pytest.raises(
        RewardError, match=r"bye\.py raised SystemExit: 4 \(worker log: .*\) \(on data row 7\)$"
    ):
        score_row(reward, EXAMPLE, "4")


def test_reward_timeout_s_is_the_workers_limit(tmp_path: Path) -> None:
    from nereus_core.config.data import DEFAULT_TIMEOUT_S, RewardConfig

    (tmp_path / "r.py").write_text(GOOD)
    config = RewardConfig(function=f"{tmp_path / 'r.py'}:score")
    assert config.timeout_s == DEFAULT_TIMEOUT_S
    worker = RewardConfig(function=config.function, timeout_s=0.5).resolve().fn
    assert isinstance(worker, RewardWorker) and worker.timeout_s == 0.5
    assert worker.settings == WorkerSettings(timeout_s=0.5)  # the config's defaults are the worker's
    with pytest.raises(ValueError, match="greater than 0"):
        RewardConfig(function=config.function, timeout_s=0)
