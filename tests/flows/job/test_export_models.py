"""``nereus export --model M`` of a model the job does not have (a GRPO run has no critic) is refused
in one line that names the models the run does have, before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.cli.main import main
from nereus_core.config import NereusConfig
from storage.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("model", ["critic", "reward", "reference"])  # the demo has no KL term
def test_export_of_a_model_a_grpo_run_lacks_names_the_models_it_has(tmp_path, capsys, model) -> None:
    cfg = NereusConfig.model_validate(yaml.safe_load((ROOT / "examples" / "tiny_grpo.yaml").read_text()))
    run = RunDir.create(tmp_path / "run", cfg.model_dump(mode="json"))
    out = tmp_path / "hf"
    code = main(["export", str(run.root), "--model", model, "--hf", str(out)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and line.startswith("nereus: error: ")
    assert line.endswith(f"this grpo run has no {model} model; export one of: actor"), line
    assert not out.exists()
