"""``nereus plan`` with packed passes: it names the token budget its memory model counts, and the
forward passes' predicted memory follows the budget; with padded passes its output has no such line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny_ppo.yaml"


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], passes: dict[str, Any] | None) -> list[str]:
    data = yaml.safe_load(EXAMPLE.read_text())
    if passes is not None:
        data["passes"] = passes
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    assert main(["plan", str(config)]) == 0
    return capsys.readouterr().out.splitlines()


def _gib_per_slot(lines: list[str], stage: str) -> float:
    (row,) = [line for line in lines if line.split()[:1] == [stage]]
    return float(row.split()[-1])


def test_plan_names_the_budget_and_the_forward_passes_memory_follows_it(tmp_path, capsys) -> None:
    padded = _plan(tmp_path, capsys, {"pack": False})
    assert not any(line.startswith("passes:") for line in padded)
    small = _plan(tmp_path, capsys, {"use_remove_padding": True, "ppo_max_token_len_per_gpu": 64})
    assert small[2] == (
        "passes: packed, max_tokens_per_device 64: a micro-batch's activations counted at its real "
        "tokens, at most 64 per device"
    )
    large = _plan(tmp_path, capsys, {"pack": True, "max_tokens_per_device": 1024})
    # the demo's 256 rows of 10 tokens on one replica: 2,560 padded tokens a micro-batch
    for stage in ("reference/infer", "reward/infer"):
        assert _gib_per_slot(small, stage) < _gib_per_slot(large, stage) < _gib_per_slot(padded, stage)


def test_plan_with_packing_and_no_budget_says_what_it_counts(tmp_path, capsys) -> None:
    lines = _plan(tmp_path, capsys, {"pack": True})
    assert lines[2] == (
        "passes: packed; a micro-batch's activations counted at its real tokens (rows x mean length)"
    )


def test_plan_with_gradient_checkpointing_says_so_and_its_train_stages_need_less(tmp_path, capsys) -> None:
    plain = _plan(tmp_path, capsys, None)
    assert not any(line.startswith("train passes:") for line in plain)
    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["gradient_checkpointing"] = True
    config = tmp_path / "checkpointed.yaml"
    config.write_text(yaml.safe_dump(data))
    assert main(["plan", str(config)]) == 0
    again = capsys.readouterr().out.splitlines()
    assert "train passes: gradient checkpointing (each layer's input kept, one more forward)" in again
    # every train layout recomputes under the flag (the table's rc column); without it the search may
    # choose recomputation per layout, so the flag never needs more
    for stage in ("actor/train", "critic/train"):
        (row,) = [line.split() for line in again if line.split()[:1] == [stage]]
        assert row[6] == "yes", row
    assert _gib_per_slot(again, "actor/train") <= _gib_per_slot(plain, "actor/train")
    assert _gib_per_slot(again, "reference/infer") == _gib_per_slot(plain, "reference/infer")
