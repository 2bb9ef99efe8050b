"""storage.sim_dir: a finished run reads back as it was written; another sweep's directory is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from nereus_core.config import ConfigError
from nereus_core.sim.job import SimResult
from storage.sim_dir import SimDir, run_file_key

IDENTITY = {"config": {"name": "a", "seeds": [0]}, "traces": {"t": "abc"}}


def _result(seed: int) -> SimResult:
    records = [
        {"step": k, "step_s": 1.5 + k, "move": None if k else "switch", "nan": math.nan} for k in range(3)
    ]
    return SimResult("t", "nereus", seed, records, {"p1": "{}"}, {"mean_step_s": 2.5, "frac": math.nan})


def test_a_finished_run_reads_back_as_written(tmp_path: Path) -> None:
    sim_dir = SimDir(tmp_path)
    sim_dir.claim(IDENTITY)
    assert sim_dir.finished() == set()
    sim_dir.write_run(_result(0))
    assert sim_dir.finished() == {run_file_key("t", "nereus", 0)}
    back = sim_dir.read_run(run_file_key("t", "nereus", 0))
    assert (back.trace, back.strategy, back.seed, back.plans) == ("t", "nereus", 0, {"p1": "{}"})
    assert back.summary["mean_step_s"] == 2.5 and math.isnan(back.summary["frac"])
    assert [r["step_s"] for r in back.records] == [1.5, 2.5, 3.5]
    assert [r["move"] for r in back.records] == ["switch", None, None]


def test_another_sweeps_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    SimDir(tmp_path).claim(IDENTITY)
    SimDir(tmp_path).check(json.loads(json.dumps(IDENTITY)))  # the same sweep: fine
    with pytest.raises(ConfigError, match="another config") as err:
        SimDir(tmp_path).check({**IDENTITY, "config": {"name": "a", "seeds": [0, 1]}})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="other traces"):
        SimDir(tmp_path).check({**IDENTITY, "traces": {"t": "def"}})


def test_tables_cover_the_runs_given(tmp_path: Path) -> None:
    sim_dir = SimDir(tmp_path)
    paths = sim_dir.write_tables([_result(0), _result(1)], {"missing": []}, {"wall_s": 1.0})
    assert {p.name for p in paths} == {"summary.json", "steps.parquet", "plans.json", "timing.json"}
    assert pq.read_table(tmp_path / "steps.parquet").num_rows == 6
