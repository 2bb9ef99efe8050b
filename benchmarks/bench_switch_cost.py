"""A live switch's critical path against its moves, as the state grows.

A GRPO job on 2 device slots (``job.switch_recovery: async``, ``verify_transitions: false``, no
reference model) switches actor/train from dp=2 to tp=2 after step 0, forced as the tests force a
switch (``tests/support/forced_switches.py``: the real controller prices it). From the run's
``metrics/transitions.parquet``: every second from the decision to the next step (``actual_s``), its
parts (the recovery point's staging, the moves, the rest: the transition subflow's flow run, journal,
records and the new layout's groups and engine) and ``critical_over_moves``. (A forced switch's row
carries the price of the controller's own decision, not of the forced plan: no prediction here.)
Fixed costs (about a second on this machine) dominate small states; the moves, large ones.

    python -m benchmarks.bench_switch_cost [--sizes 256x4 1024x8] [--recovery async none] [--out FILE]

With ``--recovery async none`` each size also runs with no recovery point: its moves' seconds are
the moves with no background write beside them (on two cores the write competes with the moves).

Each size is ``hidden x layers`` of a Llama-style model (intermediate 3 x hidden, 8 heads,
vocabulary 256). Printed JSON: per size, the parameters, the bytes moved and the figures above.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def job(hidden: int, layers: int, recovery: str = "async") -> dict[str, Any]:
    """The job for one model size (small batches and responses: the switch is what is measured)."""
    return {
        "name": f"switch-cost-{hidden}x{layers}",
        "cluster": {"devices": 2, "memory_per_device": "12GiB"},
        "model": {
            "vocab_size": 256,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
        },
        "job": {
            "steps": 2,
            "batch_size": 4,
            "prompt_len": 4,
            "response_len": 4,
            "adapt": True,
            "switch_recovery": recovery,
            "verify_transitions": False,
            "snapshot_every": 100,
        },
        "algorithm": {"name": "grpo", "group_size": 2},
        "ppo": {"kl_coef": 0.0, "use_kl_loss": False, "ppo_epochs": 1, "mini_batches": 1},
        "plan": {"actor/generate": {"devices": [0]}, "actor/train": {"dp": 2, "devices": [0, 1]}},
    }


def measure(hidden: int, layers: int, out: Path, recovery: str = "async") -> dict[str, Any]:
    """Run the job with the switch forced after step 0; the switch's figures."""
    import pyarrow.parquet as pq

    from flows.job import switch as switch_module
    from flows.job.rl_job import rl_job
    from nereus_core.config import parse_config
    from nereus_core.layout import Layout
    from nereus_core.model.weights import param_shapes
    from tests.support.forced_switches import forced_controller

    cfg = parse_config(job(hidden, layers, recovery))
    saved = switch_module.controller_step
    switch_module.controller_step = forced_controller({0: {"actor/train": Layout(tp=2, devices=(0, 1))}})
    try:
        rl_job(config=cfg, out_dir=str(out))
    finally:
        switch_module.controller_step = saved
    (row,) = pq.read_table(out / "metrics" / "transitions.parquet").to_pylist()
    parts = {k: round(float(row[k]), 3) for k in ("actual_s", "recovery_s", "moves_s")}
    params = sum(math.prod(shape) for shape in param_shapes(cfg.models["actor"]).values())
    return {
        "hidden": hidden,
        "layers": layers,
        "parameters": params,
        "status": row["status"],
        "recovery": row["recovery"],
        "staged_in_place": row["staged_in_place"],
        "bytes_moved": int(row["bytes_moved"]),
        **parts,
        "rest_s": round(parts["actual_s"] - parts["recovery_s"] - parts["moves_s"], 3),
        "critical_over_moves": round(parts["actual_s"] / parts["moves_s"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["256x4", "1024x8"], help="hidden x layers")
    parser.add_argument(
        "--recovery",
        nargs="+",
        default=["async"],
        choices=["async", "sync", "none"],
        help="job.switch_recovery modes, each size run once per mode given (none: no write beside the moves)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PREFECT_HOME"] = str(Path(tmp) / "prefect")  # a Prefect database of its own
        rows = []
        for size in args.sizes:
            hidden, layers = (int(x) for x in size.split("x"))
            for i, mode in enumerate(args.recovery):
                rows.append(measure(hidden, layers, Path(tmp) / f"{size}-{i}-{mode}", mode))
    report = {"machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()}, "switches": rows}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
