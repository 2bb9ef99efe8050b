"""flows/job/data.py with a user's reward function: the job's worker (tried once on the first row
before the start, in a temp log) writes what the function prints to the run directory's
``logs/reward_worker.log`` once the run directory is known, and nothing of it reaches the driver."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.job.data import REWARD_LOG, job_data
from nereus_core.config import parse_config
from nereus_core.prompt_source import DatasetSource
from nereus_core.rewards.worker import RewardWorker
from tests.support import hostile_inputs

LOUD = "def score(a, b, c, d):\n    print('scored', repr(b), 'against', repr(c))\n    return 1.0\n"


def test_the_jobs_reward_worker_logs_into_the_run_directory(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    raw = yaml.safe_load(hostile_inputs.base(tmp_path).read_text())
    (tmp_path / "loud.py").write_text(LOUD)
    raw["reward"] = {"function": f"{tmp_path / 'loud.py'}:score"}
    run = tmp_path / "run"
    data = job_data(parse_config(raw), run_dir=str(run))
    assert isinstance(data.train, DatasetSource) and isinstance(data.train.reward.fn, RewardWorker)
    worker = data.train.reward.fn
    tried_in = Path(worker._log or "")  # the try before the start logged to a temp file, gone now
    assert tried_in.name.startswith("nereus-reward-worker-") and not tried_in.exists()
    assert not run.exists()  # nothing made before the first call in the run
    assert worker("openai/gsm8k", "#### 4", "4", {}) == 1.0
    worker.close()
    assert (run / REWARD_LOG).read_text() == "scored '#### 4' against '4'\n"
    assert "scored" not in capfd.readouterr().out
