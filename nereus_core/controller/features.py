"""Which controller and runtime features the real Nereus job runs: the one rule for both the job's
controller (``nereus_core.job.controller_settings``) and the simulator's Nereus
(``nereus_core.sim.strategies``), so the simulator offers its Nereus nothing the runtime lacks.

- Probes of the TP collectives at the degrees the plan in force does not run
  (``ControllerSettings.probe_every``, ``controller.probe``): the job runs them after the decision
  that asks (``tasks.probes.run_probes``; ``probe_s`` and ``probes`` in the step's history row),
  and the next decision sees them; the simulator charges their seconds.
- One-step off-policy overlap of disaggregated pools (``overlap_disaggregated``): the job has none;
  pools take turns within a step.
- A switch's recovery point (``job.switch_recovery``): ``async`` (the default), ``sync`` or
  ``none``; a switch that changes the device set rehydrates from a checkpoint of the step, so it
  writes one synchronously first in every mode (``config.recovery_write``).
- Periodic checkpoints: every ``job.snapshot_every`` steps (default 10), always written
  synchronously (the step waits for them).
- Activation recomputation: a choice of each train layout (``Layout.recompute``: every decoder layer
  recomputed in the backward pass, ``model/llama.py``) that the plan search makes and the runtime runs,
  and a launch flag, ``model.gradient_checkpointing`` (``activation_recompute``), that turns it on for
  every train layout of the run. The simulated Nereus recomputes where its plan's layouts (or its
  model's flag) say, never with the world's recompute-where-nothing-fits option; a plan that does not
  fit fails its step there as it would here.
- A train pipeline's schedule (``Layout.schedule``): GPipe or 1F1B, a choice of each layout that the
  plan search makes and the runtime runs (``engine/train.py``, bit for bit alike); a plan that
  changes only it (or the micro-batches) moves no state. The simulator's world holds, for a 1F1B
  layout, the micro-batches 1F1B keeps in flight.
- Sharded data parallelism (``Layout.shard: full``): a train layout without a pipeline may shard its
  weights, gradients and optimizer state over its data-parallel ranks (DeepSpeed ZeRO-3,
  ``engine/optimizer.py``; state moves to and from it bit for bit, ``engine/state_zero3.py``), a
  choice the plan search makes and the runtime runs. The simulator's world holds a dp-th of the
  state for such a layout, as it does for the peers' FSDP and ZeRO-3, and, as for them, does not
  charge the gathers' traffic (the cost model does: ``dp_gather``). Forward stages (reference, reward,
  the critic's values) hold whole weights: the runtime has no sharded forward stage.
"""

from __future__ import annotations

from typing import get_args

from nereus_core.config import ModelConfig, RecoveryMode
from nereus_core.config.job import JobConfig
from nereus_core.controller.state import ControllerSettings

RECOVERY_MODES: tuple[RecoveryMode, ...] = get_args(RecoveryMode)
DEFAULT_RECOVERY: RecoveryMode = JobConfig.model_fields["switch_recovery"].default
SNAPSHOT_EVERY: int = JobConfig.model_fields["snapshot_every"].default
PERIODIC_CHECKPOINT: RecoveryMode = "sync"  # how a periodic checkpoint is written

# Controller settings of features the runtime lacks: the value the runtime runs, and why.
LACKS: dict[str, tuple[object, str]] = {
    "overlap_disaggregated": (
        False,
        "the Nereus runtime has no one-step off-policy overlap (disaggregated pools take turns)",
    ),
}


def runtime_settings(settings: ControllerSettings) -> ControllerSettings:
    """``settings`` with every feature the runtime lacks turned off (the values it runs)."""
    return settings.model_copy(update={name: value for name, (value, _) in LACKS.items()})


def asked_but_lacking(settings: ControllerSettings) -> list[tuple[str, str]]:
    """(field, why) for each field ``settings`` sets explicitly to a feature the runtime lacks."""
    return [
        (name, why)
        for name, (value, why) in LACKS.items()
        if name in settings.model_fields_set and getattr(settings, name) != value
    ]


def lacking(settings: ControllerSettings) -> list[str]:
    """The fields of ``settings`` whose value (explicit or default) the runtime does not run."""
    return [name for name, (value, _) in LACKS.items() if getattr(settings, name) != value]


def activation_recompute(model: ModelConfig) -> bool:
    """Whether the runtime recomputes the job's train passes: the model's launch flag."""
    return model.gradient_checkpointing
