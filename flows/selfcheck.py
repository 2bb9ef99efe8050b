"""The runtime self-check flow (`nereus selfcheck`): each layout of a plan against one device.

config --> DevicePool (Dask LocalCluster or an existing scheduler; one torch.distributed world)
       --> check_model_stage task, once per model-stage of config.plan
             (build groups, load seeded weights, forward / generate / train step,
              compare with the single-device reference)
       --> one table: run logger, terminal, Prefect artifact; summary.json in the run dir
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from rich.console import Console
from rich.table import Table

from nereus_core.config import ConfigError, NereusConfig, parse_config
from nereus_core.plan import MODEL_STAGES
from tasks.runtime.device_pool import DevicePool
from tasks.selfcheck import check_model_stage

COLUMNS = ("stage", "layout", "groups_s", "load_s", "forward_s", "train_s", "max_abs_diff", "ok")


def _resolve(config: NereusConfig | dict[str, Any] | str) -> NereusConfig:
    if isinstance(config, NereusConfig):
        return config
    if isinstance(config, str):
        config = yaml.safe_load(Path(config).read_text())
    return parse_config(config)


def _render(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="runtime self-check (median of 3 where timed)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("stage", "layout") else "right")
    for row in rows:
        cells = []
        for column in COLUMNS:
            value = row.get(column, "")
            cells.append(f"{value:.4g}" if isinstance(value, float) else str(value))
        table.add_row(*cells)
    return table


@flow(name="nereus-selfcheck", log_prints=False)
def selfcheck_flow(
    config: NereusConfig | dict[str, Any] | str, out_dir: str = "runs/selfcheck"
) -> dict[str, Any]:
    """Check every model-stage layout of ``config`` on the device pool against the reference."""
    cfg = _resolve(config)
    logger = get_run_logger()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    if not cfg.plan:
        raise ConfigError("plan: no model-stage layouts to check; add e.g. plan.actor/train")
    start = time.perf_counter()
    with DevicePool.for_cluster(cfg.cluster) as pool:
        world_s = dict(pool.timings).get(f"world {cfg.cluster.devices}", float("nan"))
        logger.info("device pool of %d slots up; world formed in %.2f s", pool.size, world_s)
        rows = [
            check_model_stage(pool, stage, cfg.plan[stage], cfg)
            for stage in MODEL_STAGES
            if stage in cfg.plan
        ]
    wall_s = time.perf_counter() - start
    Console(width=130).print(_render(rows))
    create_table_artifact(
        key="nereus-selfcheck",
        table=[{c: row.get(c, "") for c in COLUMNS} for row in rows],
        description=f"Runtime self-check of {cfg.name} on {cfg.cluster.devices} device slots",
    )
    summary = {
        "status": "ok" if all(r["ok"] for r in rows) else "mismatch",
        "kind": "selfcheck",
        "wall_s": wall_s,
        "world_s": world_s,
        "checks": rows,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if summary["status"] != "ok":
        bad = [f"{r['stage']} ({r['layout']})" for r in rows if not r["ok"]]
        raise RuntimeError(f"self-check mismatch on {', '.join(bad)}; see {out / 'summary.json'}")
    return summary
