"""nereus_core.preflight: a sequence the job can produce must fit the models' positions and the passes'
token budget, refused in one line that names both numbers and the fix before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.cli.main import main
from nereus_core.config import ConfigError, parse_config
from nereus_core.preflight import Machine, check, longest_sequence, problems, sequence_problem

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_ppo.yaml"
BIG = Machine(cpus=64, available_memory=512 * 2**30)


def demo(**sections: dict[str, Any]) -> dict[str, Any]:
    """The demo's config (prompts of 4 tokens, responses of 6, then 24 from step 25) with ``sections``."""
    data = yaml.safe_load(EXAMPLE.read_text())
    for name, fields in sections.items():
        data.setdefault(name, {}).update(fields)
    return data


def test_the_longest_sequence_counts_the_scenario_s_longer_responses() -> None:
    assert longest_sequence(parse_config(demo())) == (
        28,
        "job.prompt_len 4 + job.scenario (step 25) response_len 24",
    )
    plain = parse_config(demo(job={"scenario": []}))
    assert longest_sequence(plain) == (10, "job.prompt_len 4 + job.response_len 6")


def test_a_budget_below_the_longest_sequence_is_refused_in_one_line() -> None:
    cfg = parse_config(demo(passes={"pack": True, "max_tokens_per_device": 20}))
    line = (
        "passes.max_tokens_per_device=20 is less than the job's longest sequence, 28 tokens "
        "(job.prompt_len 4 + job.scenario (step 25) response_len 24); raise it to at least 28 or "
        "shorten the sequences"
    )
    assert sequence_problem(cfg) == line
    assert problems(cfg, BIG)[0] == line
    assert problems(cfg, BIG, resume=True) == [line]  # the config's lengths bind a resumed run too
    with pytest.raises(ConfigError) as err:
        check(cfg, BIG)
    assert str(err.value) == line


def test_verl_s_budget_name_is_refused_the_same_way_and_a_budget_of_the_longest_passes() -> None:
    verl = parse_config(
        demo(job={"scenario": []}, passes={"use_remove_padding": True, "ppo_max_token_len_per_gpu": 9})
    )
    assert sequence_problem(verl) == (
        "passes.max_tokens_per_device=9 is less than the job's longest sequence, 10 tokens "
        "(job.prompt_len 4 + job.response_len 6); raise it to at least 10 or shorten the sequences"
    )
    fits = parse_config(demo(passes={"pack": True, "max_tokens_per_device": 28}))
    assert sequence_problem(fits) is None and problems(fits, BIG) == []
    assert sequence_problem(parse_config(demo(passes={"pack": True}))) is None  # no budget: no bound


def test_a_scenario_response_past_the_model_s_positions_is_refused_in_one_line() -> None:
    # the config refuses job.prompt_len + job.response_len past the positions; a scenario event's
    # longer responses reach preflight
    cfg = parse_config(demo(job={"scenario": [{"step": 25, "response_len": 300}]}))
    assert sequence_problem(cfg) == (
        "the job's longest sequence is 304 tokens (job.prompt_len 4 + job.scenario (step 25) "
        "response_len 300), more than model.max_position_embeddings=256; shorten the prompts or responses"
    )
    with pytest.raises(ValueError, match=r"job.prompt_len\+job.response_len=304 exceeds model.max_position"):
        parse_config(demo(job={"response_len": 300, "scenario": []}))


def test_nereus_run_stops_on_the_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    verl = {"use_remove_padding": True, "ppo_max_token_len_per_gpu": 16}
    config.write_text(yaml.safe_dump(demo(passes=verl)))
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"nereus: error: {config}: passes.max_tokens_per_device=16 is less than the job's longest "
        "sequence, 28 tokens (job.prompt_len 4 + job.scenario (step 25) response_len 24); raise it to "
        "at least 28 or shorten the sequences"
    ]
    assert not out.exists()
