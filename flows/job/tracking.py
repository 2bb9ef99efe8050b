"""Metric trackers of a run (``trainer.logger``) and its progress bar.

    history row + stage rows -> step_metrics -> verl's names -> TensorBoard / MLflow / W&B
    transition row           -> transition_metrics          -> the same trackers

Each tracker writes under the run directory and needs no server: TensorBoard event files in
RUN/tensorboard, an MLflow store in RUN/mlflow (SQLite: MLflow's plain-file store is in maintenance
mode and refuses to open without an opt-in), W&B offline under RUN/wandb. ``console`` is the step
table in the run logger (flows/job/records.py). Boundary: names, values and writers only; when to
log is the records' (flows/job/records.py).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from nereus_core.config import ConfigError

# The package each tracker needs, and the extra that installs it.
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
EXTRAS = {"tensorboard": "tracking", "mlflow": "tracking", "wandb": "wandb"}

# History columns -> verl's metric names (verl/trainer/ppo: dp_actor, dp_critic, metric_utils);
# the "nereus/" ones have no verl counterpart.
HISTORY_NAMES = {
    "score": "critic/score/mean",  # the score trained on: PPO's reward model, GRPO's rule
    "rule_score": "critic/rule_score/mean",
    "kl": "actor/reward_kl_penalty",  # mean(old - reference log-prob), as verl's apply_kl_penalty
    "actor_loss": "actor/pg_loss",
    "actor_clip_frac": "actor/pg_clipfrac",
    "actor_approx_kl": "actor/ppo_kl",
    "actor_entropy": "actor/entropy",
    "actor_grad_norm": "actor/grad_norm",
    "actor_kl_loss": "actor/kl_loss",  # GRPO's KL loss term
    "critic_loss": "critic/vf_loss",
    "critic_value_clip_frac": "critic/vf_clipfrac",
    "critic_grad_norm": "critic/grad_norm",
    "prompt_len_mean": "prompt_length/mean",
    "prompt_len_max": "prompt_length/max",
    "response_len_mean": "response_length/mean",
    "response_len_max": "response_length/max",
    "response_clip_frac": "response_length/clip_ratio",
    "wall_s": "timing_s/step",
    "tokens": "nereus/generated_tokens",
    "stage_s": "nereus/stage_s",
    "overhead_s": "nereus/overhead_s",
    # each phase's wall (its pools at once on a phased plan; flows/job/phases.py)
    "phase_generate_s": "nereus/phase_generate_s",
    "phase_infer_s": "nereus/phase_infer_s",
    "phase_train_s": "nereus/phase_train_s",
}
# Stage rows (model, stage) -> verl's timing names.
STAGE_NAMES = {
    ("actor", "generate"): "timing_s/gen",
    ("reward", "infer"): "timing_s/reward",
    ("reference", "infer"): "timing_s/ref",
    ("actor", "infer"): "timing_s/old_log_prob",
    ("critic", "infer"): "timing_s/values",
    ("ppo", "advantages"): "timing_s/adv",
    ("grpo", "advantages"): "timing_s/adv",
    ("actor", "train"): "timing_s/update_actor",
    ("actor", "sync"): "timing_s/update_weights",
    ("critic", "train"): "timing_s/update_critic",
}
TRANSITION_FIELDS = ("actual_s", "predicted_cost_s", "predicted_gain_s", "checkpoint_s", "bytes_moved")


def step_metrics(stats: Mapping[str, Any], rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """One step's metrics under verl's names: its history row and the seconds of each stage."""
    out = {name: float(stats[key]) for key, name in HISTORY_NAMES.items() if key in stats}
    for r in rows:
        name = STAGE_NAMES.get((r["model"], r["stage"]), f"timing_s/{r['model']}_{r['stage']}")
        out[name] = out.get(name, 0.0) + float(r["duration_s"])
    return out


def transition_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """A transition's figures (``transition/...``), logged at the step after which it ran."""
    out = {f"transition/{k}": float(row.get(k) or 0.0) for k in TRANSITION_FIELDS}
    out["transition/forced"] = float(bool(row.get("forced")))
    out["transition/committed"] = float(row.get("status") == "committed")
    return out


def require(names: Sequence[str]) -> None:
    """``ConfigError`` in one line if a tracker's package is missing (before anything starts)."""
    missing = [n for n in names if n in PACKAGES and importlib.util.find_spec(PACKAGES[n]) is None]
    if missing:
        extras = ",".join(dict.fromkeys(EXTRAS[n] for n in missing))
        raise ConfigError(
            f"trainer.logger names {', '.join(missing)} but its package is not installed; "
            f"pip install 'nereus[{extras}]' (or drop it from trainer.logger)"
        )


class Tracker(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def close(self, failed: bool) -> None: ...


class TensorBoardTracker:
    def __init__(self, root: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # torch's writer: no TensorFlow needed

        self.writer = SummaryWriter(log_dir=str(root / "tensorboard"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class MlflowTracker:
    """One MLflow run per run directory; a resumed run logs on into the same MLflow run."""

    def __init__(self, root: Path, project: str, run_name: str, params: Mapping[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        logging.getLogger("alembic").setLevel(logging.WARNING)  # its migration lines, once per store
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        store = root / "mlflow"
        store.mkdir(exist_ok=True)
        self.client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
        exp = self.client.get_experiment_by_name(project)
        exp_id = (
            exp.experiment_id
            if exp
            else self.client.create_experiment(project, artifact_location=(store / "artifacts").as_uri())
        )
        id_file = store / "run_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            id_file.write_text(self.run_id)
            for key, value in params.items():
                self.client.log_param(self.run_id, key, value)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class WandbTracker:
    """W&B in offline mode (``wandb sync RUN/wandb/offline-run-*`` uploads it later)."""

    def __init__(self, root: Path, project: str, run_name: str, params: Mapping[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        # console off: W&B would otherwise wrap stdout and stderr, under Prefect's logs and the bar.
        quiet = wandb.Settings(
            console="off", silent=True, disable_git=True, save_code=False, x_disable_stats=True
        )
        self.run = wandb.init(
            project=project, name=run_name, dir=str(root), mode="offline", config=dict(params), settings=quiet
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        self.wandb.teardown()  # its service process ends with the run, not with the interpreter


class Trackers:
    """The run's trackers, opened together; ``log`` sends one step's metrics to each."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)

    @classmethod
    def open(
        cls, names: Sequence[str], root: Path, project: str, run_name: str, params: Mapping[str, Any]
    ) -> Trackers:
        require(names)
        opened: list[Tracker] = []
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(root))
            elif name == "mlflow":
                opened.append(MlflowTracker(root, project, run_name, params))
            elif name == "wandb":
                opened.append(WandbTracker(root, project, run_name, params))
        return cls(opened)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed)
        self.trackers = []


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as ``section.field -> text`` (MLflow's params, W&B's config), plans left out."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if key == "plan":
            continue
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:250]  # MLflow caps a param's value
    return out


class ProgressBar:
    """tqdm's bar at the foot of the terminal; while it is open, every log line printed to the terminal
    is written above it (the bar is cleared, the line printed, the bar drawn again) instead of after
    it on the same line."""

    def __init__(self, total: int, done: int, stream: TextIO) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, initial=done, unit="step", file=stream, dynamic_ncols=True, desc="nereus"
        )
        self.patched: list[tuple[logging.StreamHandler, Any]] = []
        for handler in _terminal_handlers():
            self.patched.append((handler, handler.emit))
            handler.emit = self._above(handler.emit)  # type: ignore[method-assign]

    def _above(self, emit: Any) -> Any:
        def emit_above_the_bar(record: logging.LogRecord) -> None:
            self.bar.clear()
            emit(record)
            self.bar.refresh()

        return emit_above_the_bar

    def update(self, stats: Mapping[str, Any]) -> None:
        self.bar.set_postfix(
            score=f"{stats['rule_score']:.3f}", wall=f"{stats['wall_s']:.2f}s", refresh=False
        )
        self.bar.update(1)

    def close(self) -> None:
        for handler, emit in self.patched:
            handler.emit = emit  # type: ignore[method-assign]
        self.bar.close()


def _terminal_handlers() -> list[logging.StreamHandler]:
    """Every logging handler that writes to this process's stdout or stderr (Prefect's console, Dask's)."""
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    found: dict[int, logging.StreamHandler] = {}
    for logger in loggers:
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (
                sys.stdout,
                sys.stderr,
            ):
                found[id(h)] = h
    return list(found.values())


def progress_bar(total: int, done: int, stream: TextIO | None = None) -> ProgressBar | None:
    """A progress bar with ETA on an interactive terminal; None elsewhere (Prefect's logs, CI, pipes)."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        return None
    return ProgressBar(total, done, stream)
