"""flows/job/tracking.py through flows/job/records.py: what each tracker wrote, read back with its own
reader and checked against the history table; the progress bar; the short decision line; the
resumed run's last line; the reward-fit cache per checkout."""

from __future__ import annotations

import io
import json
import logging
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flows.job import records as job_records
from flows.job import tracking
from flows.job.records import HISTORY_TABLE, JobRecords
from flows.job.start import reward_fit_cache_dir
from nereus_core.config import ConfigError, parse_config
from nereus_core.cost.transition_cost import TransitionEstimate
from nereus_core.layout import Layout
from storage.run_dir import TRANSITIONS_TABLE, RunDir

STAGES = [
    ("actor", "generate"),
    ("reward", "infer"),
    ("actor", "infer"),
    ("actor", "train"),
    ("actor", "sync"),
]


class FakeLogger:
    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []

    def log(self, level: int, msg: str, *args: Any) -> None:
        self.lines.append((level, msg % args))

    def info(self, msg: str, *args: Any) -> None:
        self.log(logging.INFO, msg, *args)

    def debug(self, msg: str, *args: Any) -> None:
        self.log(logging.DEBUG, msg, *args)


@pytest.fixture
def logger(monkeypatch) -> FakeLogger:
    """The records outside a flow run: the run logger and the artifacts are Prefect's, not tested here."""
    fake = FakeLogger()
    monkeypatch.setattr(job_records, "get_run_logger", lambda: fake)
    monkeypatch.setattr(job_records, "create_table_artifact", lambda **_: None)
    return fake


def stats_of(step: int) -> dict[str, Any]:
    """A step's statistics as flows/job/rl_job.py's run_step returns them."""
    x = step + 1
    return {
        "step": step,
        "plan_id": "p1",
        "score": 0.2 + 0.01 * x,
        "rule_score": 0.15 + 0.02 * x,
        "kl": 1e-3 * x,
        "tokens": 64,
        "actor_loss": -0.01 * x,
        "actor_clip_frac": 0.05 * x,
        "actor_approx_kl": 2e-4 * x,
        "actor_entropy": 3.4 - 0.1 * x,
        "actor_grad_norm": 0.7 * x,
        "critic_loss": 0.3 / x,
        "critic_value_clip_frac": 0.01 * x,
        "critic_grad_norm": 1.1 * x,
        "response_len_mean": 6.0,
        "response_len_max": 6.0,
        "response_clip_frac": 1.0,
    }


def run_steps(records: JobRecords, steps: range, total: int) -> None:
    for step in steps:
        for i, (model, stage) in enumerate(STAGES):
            records._row(step, "p1", (model, stage, 8, 0.1 * (i + 1) + 0.01 * step), 0.0, 0.0)
        records.finish_step(stats_of(step), wall_s=2.0 + 0.1 * step, steps=total)


def switch(forced: bool) -> SimpleNamespace:
    predicted = TransitionEstimate(
        seconds=0.5, wire_s=0.3, ops_s=0.2, critical_bytes=4096, transfers=2, analytic=False
    )
    decision = SimpleNamespace(forced=forced, gain_per_step_s=0.25, horizon_steps=10, transition=predicted)
    layouts = {"actor/train": Layout.contiguous(dp=4)}
    return SimpleNamespace(decision=decision, plan_id="p2", reason="why", devices=4, layouts=layouts)


def config(*loggers: str, steps: int = 3):
    return parse_config({"name": "track", "job": {"steps": steps}, "trainer": {"logger": list(loggers)}})


@pytest.fixture
def tracked_run(tmp_path, logger) -> RunDir:
    """Three steps and a forced transition after step 1, logged to every tracker."""
    run = RunDir.create(tmp_path / "run", {"name": "track"})
    records = JobRecords(run, config=config("console", "tensorboard", "mlflow", "wandb"))
    with records.tracking():
        run_steps(records, range(2), 3)
        stats = {"seconds": 1.25, "bytes_moved": 4096, "route": "live", "checkpoint_s": 0.3}
        records.transition("t000-step1", 1, SimpleNamespace(plan_id="p1"), switch(True), stats, "committed")
        run_steps(records, range(2, 3), 3)
    return run


def expected(run: RunDir) -> dict[str, dict[int, float]]:
    """What every tracker must hold: the history table and the stage rows under verl's names."""
    out: dict[str, dict[int, float]] = {}
    stage_rows = run.read_rows("metrics/steps.parquet")
    for h in run.read_rows(HISTORY_TABLE):
        rows = [r for r in stage_rows if r["step"] == h["step"]]
        for name, value in tracking.step_metrics(h, rows).items():
            out.setdefault(name, {})[h["step"]] = value
    for t in run.read_rows(TRANSITIONS_TABLE):
        for name, value in tracking.transition_metrics(t).items():
            out.setdefault(name, {})[t["step"]] = value
    return out


def test_step_metrics_use_verls_names_for_every_history_statistic():
    rows = [{"model": m, "stage": s, "duration_s": 0.5} for m, s in STAGES] + [
        {"model": "actor", "stage": "generate", "duration_s": 0.25}  # two calls of one stage add up
    ]
    got = tracking.step_metrics({**stats_of(0), "wall_s": 2.0, "stage_s": 1.5, "overhead_s": 0.5}, rows)
    for name in (
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/pg_loss",
        "critic/vf_clipfrac",
        "critic/vf_loss",
        "critic/grad_norm",
        "critic/score/mean",
        "response_length/mean",
        "response_length/max",
        "response_length/clip_ratio",
        "timing_s/step",
        "timing_s/update_actor",
        "timing_s/update_weights",
        "timing_s/old_log_prob",
    ):
        assert name in got, name
    assert got["timing_s/gen"] == 0.75 and got["actor/pg_clipfrac"] == pytest.approx(0.05)
    assert set(tracking.HISTORY_NAMES) >= set(stats_of(0)) - {"step", "plan_id"}  # none left out


def test_tensorboard_holds_every_metric_of_the_history_table(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tracked_run.root / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    want = expected(tracked_run)
    assert set(acc.Tags()["scalars"]) == set(want)
    for name, by_step in want.items():
        got = {e.step: e.value for e in acc.Scalars(name)}
        assert got == pytest.approx(by_step, rel=1e-6), name  # event files keep float32
    assert want["transition/forced"] == {1: 1.0} and want["transition/actual_s"] == {1: 1.25}


def test_mlflow_holds_every_metric_of_the_history_table(tracked_run):
    from mlflow.tracking import MlflowClient

    store = tracked_run.root / "mlflow"
    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    run = client.get_run((store / "run_id").read_text())
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["job.steps"] == "3"
    want = expected(tracked_run)
    assert set(run.data.metrics) == set(want)
    for name, by_step in want.items():
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert got == pytest.approx(by_step, rel=1e-12), name


def wandb_history(path: Path) -> list[dict[str, Any]]:
    """The history records of an offline W&B run file: a LevelDB-style log of protobuf records
    (32 KiB blocks; each record: CRC32, length, type 1 full / 2 first / 3 middle / 4 last) after a
    7-byte ':W&B' header. W&B ships no reader of its own any more."""
    from wandb.proto import wandb_internal_pb2

    data, pos, out, part = path.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                out.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                )
    return out


def test_wandb_offline_holds_every_metric_of_the_history_table(tracked_run):
    files = list((tracked_run.root / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    got: dict[str, dict[int, float]] = {}
    for row in wandb_history(files[0]):
        step = row["_step"]
        for name, value in row.items():
            if not name.startswith("_"):
                got.setdefault(name, {})[step] = value
    assert got == expected(tracked_run)


def test_a_resumed_run_logs_on_into_the_same_mlflow_run(tmp_path, logger):
    from mlflow.tracking import MlflowClient

    run = RunDir.create(tmp_path / "run", {"name": "track"})
    cfg = config("mlflow", steps=4)
    records = JobRecords(run, config=cfg)
    with records.tracking():
        run_steps(records, range(2), 4)
    resumed = JobRecords(run, first_step=2, config=cfg)
    with resumed.tracking():
        run_steps(resumed, range(2, 4), 4)
    store = run.root / "mlflow"
    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    history = client.get_metric_history((store / "run_id").read_text(), "actor/pg_clipfrac")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]


def test_a_failed_run_is_marked_failed_in_mlflow(tmp_path, logger):
    from mlflow.tracking import MlflowClient

    run = RunDir.create(tmp_path / "run", {"name": "track"})
    records = JobRecords(run, config=config("mlflow"))
    with pytest.raises(RuntimeError), records.tracking():
        run_steps(records, range(1), 3)
        raise RuntimeError("a step failed")
    store = run.root / "mlflow"
    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    assert client.get_run((store / "run_id").read_text()).info.status == "FAILED"


def test_a_missing_tracker_package_is_refused_in_one_line(monkeypatch):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda n: None if n == "mlflow" else real(n))
    with pytest.raises(ConfigError) as err:
        tracking.require(["console", "tensorboard", "mlflow"])
    line = str(err.value)
    assert "\n" not in line and "mlflow" in line and "tensorboard" not in line
    assert "pip install 'nereus[tracking]'" in line
    tracking.require(["console", "tensorboard"])  # the ones installed pass


def test_steps_are_0_based_in_the_step_line_and_the_table_goes_to_debug_without_console(tmp_path, logger):
    run = RunDir.create(tmp_path / "run", {"name": "track"})
    records = JobRecords(run, config=config("tensorboard"))
    with records.tracking():
        run_steps(records, range(2), 3)
    heads = [(level, text.splitlines()[0]) for level, text in logger.lines]
    assert heads == [(logging.DEBUG, "step 0 (of 0-2)"), (logging.DEBUG, "step 1 (of 0-2)")]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_shows_steps_and_eta_on_a_terminal_only():
    assert tracking.progress_bar(10, 0, stream=io.StringIO()) is None  # a pipe, Prefect's logs, CI
    term = Terminal()
    bar = tracking.progress_bar(10, 4, stream=term)  # resumed after 4 steps
    assert bar is not None
    bar.update({"rule_score": 0.5, "wall_s": 1.0})
    bar.update({"rule_score": 0.625, "wall_s": 1.0})
    bar.close()
    shown = term.getvalue().split("\r")[-1]
    assert "6/10" in shown and "<" in shown and "score=0.625" in shown  # elapsed<remaining: the ETA


def screen(text: str) -> list[str]:
    """What a terminal shows for ``text``: a carriage return moves back to the start of the line."""
    lines, line, col = [], [], 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            line[col : col + 1] = [ch]
            col += 1
    return [*lines, "".join(line).rstrip()]


def test_log_lines_are_printed_above_the_bar_not_after_it(monkeypatch):
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    logger = logging.getLogger("test-tracking-terminal")
    handler = logging.StreamHandler(term)
    logger.addHandler(handler)
    try:
        bar = tracking.progress_bar(3, 0, stream=term)
        assert bar is not None
        bar.update({"rule_score": 0.5, "wall_s": 1.0})
        logger.warning("a log line")
        shown = screen(term.getvalue())
        assert shown[0] == "a log line", shown  # not "nereus: 33%|... a log line"
        assert shown[1].startswith("nereus:") and "1/3" in shown[1], shown  # the bar, under it
        bar.close()
        assert handler.emit.__name__ == "emit"  # the handler is itself again
    finally:
        logger.removeHandler(handler)


def test_the_decision_line_is_short_and_its_details_are_at_debug(logger):
    alternatives = tuple(
        SimpleNamespace(plan_id=f"p{i}", reason="slower", detail="x" * 300) for i in range(3)
    )
    decision = SimpleNamespace(
        action="keep",
        forced=False,
        reason="gain 0.01 s/step x 30 steps = 0.3 s < 1.2 x move 4.1 s " + "y" * 200,
        gain_per_step_s=0.01,
        horizon_steps=30,
        transition=SimpleNamespace(seconds=4.1),
        alternatives=alternatives,
        elapsed_s=0.002,
    )
    job_records.log_decision(decision, 3)
    info = [text for level, text in logger.lines if level == logging.INFO]
    assert len(info) == 1 and len(info[0]) <= 160 and info[0].startswith("controller after step 3: keep")
    debug = [text for level, text in logger.lines if level == logging.DEBUG]
    assert len(debug) == 4 and "y" * 200 in debug[0]


def test_the_done_line_counts_every_step_and_the_run_time_before_a_resume(tmp_path, logger):
    run = RunDir.create(tmp_path / "run", {"name": "track"})
    records = JobRecords(run, config=config("console", steps=4))
    with records.tracking():
        run_steps(records, range(2), 4)
    before = run.read_rows(HISTORY_TABLE)[-1]["run_s"]
    resumed = JobRecords(run, first_step=2, config=config("console", steps=4))
    with resumed.tracking():
        run_steps(resumed, range(2, 4), 4)
    state = SimpleNamespace(plan_id="p1")
    summary = resumed.summary(state, wall_s=10.0, fit={})
    assert summary["steps"] == 4 and summary["steps_after_resume"] == 2
    assert summary["run_s"] == pytest.approx(before + 10.0)
    line = job_records.done_line(summary)
    assert line.startswith(f"done: 4 steps, 2 of them after the resume, in {before + 10.0:.1f} s")


def test_artifact_numbers_are_rounded_to_4_significant_digits():
    assert job_records.rounded(0.123456789) == 0.1235
    assert job_records.rounded(12345.678) == 12350.0
    assert job_records.rounded(3.0000000000000004e-05) == 3e-05
    assert job_records.rounded(7) == 7 and job_records.rounded("a") == "a" and job_records.rounded(0.0) == 0.0


def test_the_reward_fit_cache_is_per_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("NEREUS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    one = reward_fit_cache_dir(tmp_path / "a" / "nereus")
    two = reward_fit_cache_dir(tmp_path / "b" / "nereus")
    assert one != two and Path(one).parent == Path(two).parent == tmp_path / "nereus"
    assert reward_fit_cache_dir() == reward_fit_cache_dir(Path(__file__).resolve().parents[3])
    monkeypatch.setenv("NEREUS_CACHE_DIR", str(tmp_path / "mine"))
    assert reward_fit_cache_dir() == str(tmp_path / "mine")
