"""docs/results/README.md indexes every results file and says whether its figures were measured on
real runs or come from the simulator's world, so no simulated figure reads as a measurement."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
KINDS = {"measured", "simulated", "both"}


def _index() -> dict[str, str]:
    rows = re.findall(r"^\| \[([^\]]+)\]\([^)]+\) \| (\w+) \|", (RESULTS / "README.md").read_text(), re.M)
    return dict(rows)


def test_every_results_file_is_indexed_with_its_kind() -> None:
    index = _index()
    files = {p.name for p in RESULTS.glob("*.md") if p.name != "README.md"}
    assert files <= set(index), f"not in docs/results/README.md: {sorted(files - set(index))}"
    assert set(index) <= files, f"indexed but missing: {sorted(set(index) - files)}"
    bad = {name: kind for name, kind in index.items() if kind not in KINDS}
    assert not bad, f"kinds must be one of {sorted(KINDS)}: {bad}"


def test_a_simulated_file_says_so_in_its_opening() -> None:
    index = _index()
    for name, kind in index.items():
        if kind == "simulated":
            head = (RESULTS / name).read_text()[:600]
            assert "Simulated, not measured" in head, f"{name} is simulated but its opening does not say so"
