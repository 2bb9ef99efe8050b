"""``nereus plan`` states the disk a run's checkpoints take: one checkpoint's bytes per model and the
most ``job.keep_checkpoints`` lets the run directory hold at once (or, keeping all, by the end)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from flows.cli.main import main
from flows.cli.plan_command import checkpoint_bytes
from nereus_core.config import parse_config

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny_ppo.yaml"
MIB = 2**20


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], **job: object) -> tuple[str, float]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["job"].update(job)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    assert main(["plan", str(config)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("checkpoints: ")]
    return line, sum(checkpoint_bytes(parse_config(data)).values()) / MIB


def _mib(text: str) -> float:
    return float(re.fullmatch(r"([\d.]+) MiB", text).group(1))


def test_the_plan_states_a_checkpoints_bytes_and_the_bound_keep_checkpoints_sets(tmp_path, capsys) -> None:
    line, one = _plan(tmp_path, capsys, steps=40, snapshot_every=10, keep_checkpoints=2)
    each = re.search(r"checkpoints: (\S+ MiB) each \(actor (\S+ MiB), critic (\S+ MiB), reference", line)
    assert each and _mib(each.group(1)) == pytest.approx(one, abs=0.05)
    per_model = checkpoint_bytes(parse_config(yaml.safe_load(EXAMPLE.read_text())))
    # the actor's holds AdamW's two moments (and its step count) besides the reference's parameters
    assert 3 * per_model["reference"] < per_model["actor"] <= 3 * per_model["reference"] + 64
    assert "every 10 steps and at the end" in line
    bound = re.search(r"the newest 2 kept: at most 3 at once, (\S+ MiB)$", line)
    assert bound and _mib(bound.group(1)) == pytest.approx(3 * one, abs=0.05)


def test_keeping_all_states_what_the_run_writes_by_the_end(tmp_path, capsys) -> None:
    line, one = _plan(tmp_path, capsys, steps=40, snapshot_every=10, keep_checkpoints=0)
    total = re.search(r"all kept: 4 by the end, (\S+ MiB)", line)  # steps 10, 20, 30 and 40
    assert total and _mib(total.group(1)) == pytest.approx(4 * one, abs=0.05)
