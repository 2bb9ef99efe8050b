"""``nereus run`` checks the job's data before Prefect and Dask start and hands what it made to the flow
as its ``prepared`` parameter: the data is made once, and nothing is parked between the two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.cli import main as cli_main
from flows.cli import stopping as cli_stopping
from flows.job import data as job_data_module
from flows.job import rl_job as rl_job_module
from flows.job.data import Prepared, job_data, prepare
from nereus_core.config import parse_config
from nereus_core.prompt_source import DatasetSource
from tests.support import hostile_inputs


def _counting_sources(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts how often the dataset, tokenizer and reward are loaded."""
    made: list[int] = []
    real = job_data_module._dataset_sources

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(job_data_module, "_dataset_sources", counted)
    return made


def test_the_prepared_data_is_used_as_given_and_never_parked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _counting_sources(monkeypatch)
    cfg = parse_config(yaml.safe_load(hostile_inputs.base(tmp_path).read_text()))
    prepared = prepare(cfg)
    assert isinstance(prepared, Prepared) and isinstance(prepared.data.train, DatasetSource)
    assert job_data(cfg, prepared=prepared) is prepared.data and made == [1]  # taken, not made again
    # Without it, the flow (a deployment's run) makes its own: no earlier preparation is picked up.
    assert job_data(cfg) is not prepared.data and made == [1, 1]


def test_nereus_run_prepares_once_and_hands_the_data_to_the_flow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _counting_sources(monkeypatch)
    given: dict[str, Any] = {}

    def flow(**kwargs: Any) -> dict[str, Any]:
        given.update(kwargs)
        return {}

    monkeypatch.setattr(rl_job_module, "rl_job", flow)
    monkeypatch.setattr(cli_main, "_prefect_problem", lambda: None)  # no server: the flow is a fake
    monkeypatch.setattr(cli_stopping, "install_for_run", lambda *args: None)
    config = hostile_inputs.base(tmp_path)
    assert cli_main.main(["run", str(config), "--out", str(tmp_path / "run")]) == 0
    assert made == [1]
    assert isinstance(given["prepared"], Prepared) and isinstance(given["prepared"].data.train, DatasetSource)
    assert given["out_dir"] == str(tmp_path / "run")


def test_the_prepared_data_is_stored_by_prefect_as_a_placeholder() -> None:
    # A flow run's parameters are stored as JSON; the prompts and tokenizer are not copied into it.
    from nereus_core.prompt_source import CountSource

    data = job_data_module.JobData(CountSource.__new__(CountSource))
    assert rl_job_module.rl_job.serialize_parameters({"prepared": Prepared(data)}) == {
        "prepared": "<Prepared>"
    }
