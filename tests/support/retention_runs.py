"""Runs for the checkpoint retention tests: a small GRPO job with a checkpoint every few steps, and
two injected failures. The first snapshot write of the run fails (the ``fail-snapshot-write`` fault
point: disk full, once in the one worker that writes snapshots), so the first periodic checkpoint
fails once and its retry succeeds; every attempt at the checkpoint of step ``broken`` fails
(``job_ops.checkpoint`` patched to raise EIO)."""

from __future__ import annotations

import copy
import errno
from pathlib import Path
from typing import Any

import pytest

from flows.job.rl_job import rl_job
from nereus_core import faults
from nereus_core.config import parse_config
from tasks import job_ops
from tests.support.job_configs import SMALL_MODEL

MODELS = ("actor", "reference")  # a GRPO job with a KL loss: the models whose state is checkpointed

# No critic, no reward model, one slot: every model's state on slot 0, so the fault point fires in
# the one worker that writes snapshots, exactly once.
RETAINED: dict[str, Any] = {
    "name": "retention-test",
    "cluster": {"devices": 1},
    "model": dict(SMALL_MODEL),
    "job": {"batch_size": 8, "prompt_len": 4, "response_len": 4, "adapt": False},
    "algorithm": {"name": "grpo", "group_size": 4},
    "ppo": {"kl_coef": 0.0, "use_kl_loss": True, "kl_loss_coef": 0.01, "ppo_epochs": 1, "mini_batches": 1},
}


def retention_config(*, steps: int, every: int, keep: int) -> dict[str, Any]:
    data = copy.deepcopy(RETAINED)
    data["job"].update(steps=steps, snapshot_every=every, keep_checkpoints=keep)
    return data


def run_with_failures(out: Path, data: dict[str, Any], broken: int) -> Path:
    """Run ``data`` into ``out`` with both failures injected (see the module doc)."""
    written = job_ops.checkpoint

    def checkpoint(pool: Any, run_dir: str, state: Any, step: int, **kwargs: Any) -> float:
        if step == broken:
            raise OSError(errno.EIO, "Input/output error (injected) writing the checkpoint")
        return written(pool, run_dir, state, step, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(job_ops, "checkpoint", checkpoint)
        faults.arm(["fail-snapshot-write"])  # as the CLI does; the device pool arms its worker
        try:
            rl_job(config=parse_config(data), out_dir=str(out))
        finally:
            faults.arm(())
    return out


def steps_on_disk(run_dir: Path, model: str) -> list[int]:
    """The steps of ``model``'s snapshot directories, committed or not."""
    return sorted(int(p.name.split("=")[1]) for p in (run_dir / "state" / model).iterdir())
