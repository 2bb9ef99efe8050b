"""Do two runs of the same config agree on everything but time? Prints JSON.

    python -m benchmarks.compare_runs RUN_A RUN_B

Compares every field of metrics/history.parquet that is not a timing (a name ending in ``_s`` or
starting with ``phase_``), the steps table's (step, model, stage, tokens) rows and every rollout
(token ids, log-probs, scores: exact equality). A refactor that must not change behaviour is
checked by running the same config (with ``job.adapt=false``: the controller decides on measured
seconds, so an adaptive run's plans follow the machine's load) before and after, then this.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from storage.run_dir import STEPS_TABLE, RunDir

HISTORY = "metrics/history.parquet"


def timing(name: str) -> bool:
    return name.endswith("_s") or name.startswith("phase_")


def _same(x: Any, y: Any) -> bool:
    both_nan = isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
    return x == y or both_nan


def history_differences(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """The first differing step of each non-timing field (and a row-count mismatch)."""
    out = [f"history rows: {len(a)} != {len(b)}"] if len(a) != len(b) else []
    fields = sorted({k for row in a + b for k in row if not timing(k)})
    for field in fields:
        for ra, rb in zip(a, b, strict=False):
            x, y = ra.get(field, "<missing>"), rb.get(field, "<missing>")
            if not _same(x, y):
                out.append(f"step {ra.get('step')} {field}: {x!r} != {y!r}")
                break
    return out


def step_rows(run: RunDir) -> set[tuple[Any, ...]]:
    return {(r["step"], r["model"], r["stage"], r["tokens"]) for r in run.read_rows(STEPS_TABLE)}


def compare(a: RunDir, b: RunDir) -> dict[str, Any]:
    history_a, history_b = a.read_rows(HISTORY), b.read_rows(HISTORY)
    differences = history_differences(history_a, history_b)
    only_a, only_b = step_rows(a) - step_rows(b), step_rows(b) - step_rows(a)
    if only_a or only_b:
        differences.append(f"steps table: only in A {sorted(only_a)[:3]}, only in B {sorted(only_b)[:3]}")
    steps = [int(r["step"]) for r in history_a]
    rollouts_differ = [s for s in steps if a.read_rollout(s) != b.read_rollout(s)]
    if rollouts_differ:
        differences.append(f"rollouts differ at steps {rollouts_differ[:5]}")
    return {
        "run_a": str(a.root),
        "run_b": str(b.root),
        "history_rows": len(history_a),
        "fields_compared": len({k for r in history_a for k in r if not timing(k)}),
        "rollouts_compared": len(steps),
        "same": not differences,
        "differences": differences[:20],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    args = parser.parse_args()
    report = compare(RunDir(args.run_a), RunDir(args.run_b))
    print(json.dumps(report, indent=2))
    raise SystemExit(0 if report["same"] else 1)


if __name__ == "__main__":
    main()
