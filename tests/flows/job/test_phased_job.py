"""A PPO job on a phased plan (tests/support/phased_jobs.py): the stages of one phase run at once,
and the job computes what the same layouts compute run one stage after another.

Both runs are the same job on the same layouts; the serial one sets ``flows.job.phases.AT_ONCE``
off, which runs every phase as one pool (one forward-pass task, then one train task after the
other), as the runtime ran every plan before phased plans. The overlap check is made on both runs:
it holds on the phased run and not on the serial one, so it can tell them apart."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from flows.job import phases
from flows.job.rl_job import rl_job
from nereus_core.config import parse_config
from storage import read_full_state
from storage.run_dir import RunDir
from tests.support.phased_jobs import intervals, overlap, phased_job, shared

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

MODELS = ("actor", "critic", "reference", "reward")
TRAIN = ("actor/train", "critic/train")
POOL_01 = ("actor/infer", "reference/infer")  # old log-probs on actor/train's slots 0-1
POOL_23 = ("critic/infer", "reward/infer")


def _run(root: Path, *, at_once: bool) -> Path:
    out = root / ("phased" if at_once else "serial")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEREUS_CACHE_DIR", str(root / "cache"))
        mp.setattr(phases, "AT_ONCE", at_once)
        rl_job(config=parse_config(phased_job()), out_dir=str(out))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("phased")
    # one server for both runs
    return {"phased": _run(root, at_once=True), "serial": _run(root, at_once=False)}


def _rows(run_dir: Path) -> list[dict]:
    return pq.read_table(run_dir / "metrics" / "steps.parquet").to_pylist()


@pytest.mark.timeout(600)
def test_the_stages_of_one_phase_run_at_once_on_a_phased_plan(runs) -> None:
    shared_s: dict[str, list[tuple[float, float]]] = {}
    for name, run_dir in runs.items():
        for step in (0, 1):
            found = intervals(_rows(run_dir), step, (*TRAIN, *POOL_01, *POOL_23))
            train = overlap(found["actor/train"], found["critic/train"])
            shared_s.setdefault(name, []).append((train, shared(found, POOL_01, POOL_23)))
    # phased: the train stages overlap in every step; the forward passes (a few milliseconds each
    # here, so a thread's start can outlast a pool) in some step. Serial: nothing ever overlaps.
    assert all(train > 0 for train, _ in shared_s["phased"]), shared_s
    assert any(infer > 0 for _, infer in shared_s["phased"]), shared_s
    assert all(train == infer == 0 for train, infer in shared_s["serial"]), shared_s
    history = RunDir(runs["phased"]).read_rows("metrics/history.parquet")
    for h in history:  # each phase's wall, and how many pools ran in it at once
        assert h["phase_generate_pools"] == 1 and h["phase_infer_pools"] == h["phase_train_pools"] == 2
        assert 0 < h["phase_generate_s"] + h["phase_infer_s"] + h["phase_train_s"] <= h["wall_s"]
    serial = RunDir(runs["serial"]).read_rows("metrics/history.parquet")
    assert all(h["phase_infer_pools"] == h["phase_train_pools"] == 1 for h in serial)
    phase_of = {(r["model"], r["stage"]): r["phase"] for r in _rows(runs["phased"])}
    assert phase_of[("actor", "generate")] == "generate" and phase_of[("actor", "infer")] == "infer"
    assert phase_of[("critic", "train")] == phase_of[("actor", "sync")] == "train"
    assert phase_of[("ppo", "advantages")] is None  # driver work between phases belongs to none


def test_a_phased_plan_computes_what_the_same_layouts_compute_serially(runs) -> None:
    phased, serial = (RunDir(runs[k]) for k in ("phased", "serial"))
    assert phased.read_summary()["final_plan_id"] == serial.read_summary()["final_plan_id"]
    keys = ("score", "rule_score", "kl", "actor_loss", "actor_clip_frac", "actor_approx_kl")
    keys += ("actor_entropy", "actor_grad_norm", "critic_loss", "critic_value_clip_frac", "critic_grad_norm")
    got, want = phased.read_rows("metrics/history.parquet"), serial.read_rows("metrics/history.parquet")
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert {k: g[k] for k in keys} == {k: w[k] for k in keys}, g["step"]  # bit for bit
    for step in (0, 1):
        a, b = phased.read_rollout(step), serial.read_rollout(step)
        for column in ("responses", "old_logp", "ref_logp", "values", "rewards", "advantages"):
            assert a[column] == b[column], (step, column)
    for model in MODELS:  # every model's state after the last step, optimizer included
        a = read_full_state(runs["phased"], model, 2, optimizer=True)
        b = read_full_state(runs["serial"], model, 2, optimizer=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), model
