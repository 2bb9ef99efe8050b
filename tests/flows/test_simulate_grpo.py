"""`nereus simulate` on a GRPO config: the summary names the job's stages, the step table has their
columns only, every strategy reports; a trace whose batch does not split into groups is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from flows.cli.main import main
from flows.simulate import run_simulation

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

HEADER = "step,devices,capacity_gb,batch,prompt_len,response_mean,response_p90,response_max"
STRATEGIES = {
    "nereus": {"kind": "nereus"},
    "static": {"kind": "static"},
    "openrlhf": {"kind": "openrlhf", "tune_steps": 2},
    "verl": {"kind": "verl", "tune_steps": 2},
}


def write_config(tmp_path: Path, group_size: int) -> Path:
    rows = [HEADER] + [
        f"{k},16,80,1024,100,{600 + 40 * k},{1200 + 80 * k},{1800 + 120 * k}" for k in range(3)
    ]
    (tmp_path / "tiny.csv").write_text("\n".join(rows) + "\n")
    config = {
        "name": "sim-grpo-test",
        "algorithm": {"name": "grpo", "group_size": group_size},
        "kl": False,
        "seeds": [0],
        "sweep": {"mode": "inprocess"},
        "strategies": STRATEGIES,
        "traces": [{"name": "tiny", "file": "tiny.csv"}],
    }
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_flow_simulates_grpo_for_every_strategy(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_simulation(write_config(tmp_path, 8), out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "grpo" and summary["group_size"] == 8
    assert summary["stages"] == ["actor/generate", "actor/train"]
    per = summary["traces"]["tiny"]["strategies"]
    assert set(per) == set(STRATEGIES) and all(p["throughput_tokens_per_s"] > 0 for p in per.values())
    columns = set(pq.read_table(out / "steps.parquet").column_names)
    assert {"actor_generate_s", "actor_train_s"} <= columns
    assert not columns & {"critic_infer_s", "critic_train_s", "reference_infer_s", "reward_infer_s"}
    for description in json.loads((out / "plans.json").read_text()).values():
        assert "critic/" not in json.dumps(description) and "reward/" not in json.dumps(description)


def test_a_batch_that_does_not_split_into_groups_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    path = write_config(tmp_path, 48)  # 1024 sequences are not whole groups of 48
    assert main(["simulate", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "traces.tiny: step 0, column batch: " in err[0], err
    assert "algorithm.group_size=48" in err[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "name",
    ["paper_sim.yaml", "paper_sim_grpo.yaml", "paper_sim_churn.yaml", "paper_sim_churn_recompute.yaml"],
)
def test_the_shipped_simulation_configs_pass_the_group_check(name: str) -> None:
    from flows.simulate import check_groups, read_sim_config
    from tasks.sim_tasks import load_traces

    path = Path(__file__).resolve().parents[2] / "examples" / name
    config = read_sim_config(path)
    traces = load_traces.fn(config, str(path.parent))
    check_groups(config, traces)
    for spec in config.traces:  # how devices leave travels from the config to the trace
        assert traces[spec.name].shrinks == spec.shrinks
    if name == "paper_sim_churn.yaml":
        assert {t.name: t.shrinks for t in traces.values()}["churn-p90"] == "unplanned"
