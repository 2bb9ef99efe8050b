"""Bounds a run must meet before anything starts: sequences that fit the models' positions and the
passes' token budget, devices the pool can supply, a rollout batch that fits in the driver's memory,
an initial plan that fits each device slot's memory and, on a local cluster, the machine's memory
(its slots are worker processes on this machine).

Boundary: pure checks of a validated ``NereusConfig`` against facts about the machine that the
caller passes in (``Machine``: CPU count, memory available to the driver). Reading those facts,
and starting Prefect, Dask or a run directory, is the CLI's business; it calls ``check`` first, so
a config that cannot run is refused in one line within seconds instead of minutes into a run.

What is not checked here: the size of an external Dask pool (``cluster.scheduler_address``; the
scheduler's workers are counted when the pool starts), and plans the controller switches to later
(it only picks plans that fit, ``controller.decide``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nereus_core.config import ConfigError, NereusConfig, Workload
from nereus_core.controller.decide import ControllerState, evaluate_plan
from nereus_core.cost.hardware import get_profile
from nereus_core.cost.plan_estimate import memory_per_device
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan, ModelStage, default_plan, model_of

if TYPE_CHECKING:
    from nereus_core.job import JobState

# A local device slot is a worker process; on a CPU machine several share a core (the demo runs 4
# slots on 2 cores). Past this many per CPU a LocalCluster only thrashes, and thousands of
# processes exhaust the machine before the first step.
LOCAL_SLOTS_PER_CPU = 4

# Columns the driver holds per token of a step's rollout (nereus_core/rl/rollout.py, ``Rollout``):
# the token ids over prompt + response, the prompt's padding mask and seven response-aligned columns.
# Counted at 8 bytes a value over the whole sequence, an upper bound of the tensors (int64 ids,
# float32 values).
ROLLOUT_TOKEN_COLUMNS = (
    "ids",
    "prompt_mask",
    "mask",
    "old_logp",
    "rollout_logp",  # the rollout engine's own log-probs (rollout.engine: vllm)
    "ref_logp",
    "values",
    "rewards",
    "advantages",
    "returns",
)
BYTES_PER_VALUE = 8
# The rollout's tensors may take at most this share of the memory available to the driver: it also
# holds their copies on the way to Parquet and the batches it hands to the stages.
DRIVER_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class Machine:
    """What the driver's machine offers, read by the caller (``os``, ``/proc/meminfo``)."""

    cpus: int
    available_memory: int | None  # bytes the driver may still allocate; None when unknown
    max_local_devices: int | None = None  # an explicit ceiling; None: cpus * LOCAL_SLOTS_PER_CPU

    @property
    def local_devices(self) -> int:
        """The most device slots a LocalCluster on this machine may have."""
        if self.max_local_devices is not None:
            return self.max_local_devices
        return max(self.cpus, 1) * LOCAL_SLOTS_PER_CPU

    def local_devices_why(self) -> str:
        if self.max_local_devices is not None:
            return f"the explicit ceiling of {self.max_local_devices}"
        return f"{max(self.cpus, 1)} CPUs x {LOCAL_SLOTS_PER_CPU} slots per CPU"


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def devices_problem(cfg: NereusConfig, machine: Machine, *, devices: int | None = None) -> str | None:
    """Why the run's device slots exceed what a local cluster can supply, or None.

    ``devices`` is ``nereus resume --devices N`` (it replaces ``cluster.devices``). Scenario events
    that grow the pool count too. With ``cluster.scheduler_address`` nothing is checked here."""
    if devices is not None and devices < 1:
        return f"--devices {devices}: give at least 1 device slot"
    if cfg.cluster.scheduler_address:
        return None
    limit = machine.local_devices
    fix = "or give cluster.scheduler_address (an existing Dask pool)"
    wanted = [("--devices" if devices is not None else "cluster.devices", devices or cfg.cluster.devices)]
    wanted += [(f"job.scenario (step {e.step}) devices", e.devices) for e in cfg.job.scenario if e.devices]
    for what, n in wanted:
        if n > limit:
            sep = " " if what == "--devices" else "="
            return (
                f"{what}{sep}{n} exceeds the {limit} device slots a local cluster may have on this "
                f"machine ({machine.local_devices_why()}); lower it, {fix}"
            )
    return None


def rollout_bytes(cfg: NereusConfig) -> int:
    """Upper bound of one step's rollout tensors in the driver, at the longest response the job sets."""
    tokens = cfg.job.prompt_len + max(cfg.job.response_lens())
    return cfg.job.batch_size * tokens * len(ROLLOUT_TOKEN_COLUMNS) * BYTES_PER_VALUE


def batch_problem(cfg: NereusConfig, machine: Machine) -> str | None:
    """Why a step's rollout would not fit in the driver's memory, or None (also when it is unknown)."""
    if machine.available_memory is None:
        return None
    need, budget = rollout_bytes(cfg), int(machine.available_memory * DRIVER_MEMORY_SHARE)
    if need <= budget:
        return None
    job = cfg.job
    return (
        f"job.batch_size={job.batch_size}: a step's rollout ({job.batch_size} x "
        f"{job.prompt_len + max(job.response_lens())} tokens x {len(ROLLOUT_TOKEN_COLUMNS)} columns) "
        f"needs {_size(need)} in the driver, more than {DRIVER_MEMORY_SHARE:.0%} of the "
        f"{_size(machine.available_memory)} available; lower job.batch_size or the sequence lengths"
    )


def longest_sequence(cfg: NereusConfig) -> tuple[int, str]:
    """The longest sequence the job can produce (prompt + new tokens, at the longest response it or a
    scenario event sets) and the config keys it comes from."""
    job = cfg.job
    prompt_key, response_key = (
        ("job.prompt_len", "job.response_len")
        if cfg.data is None
        else ("data.max_prompt_length", "data.max_response_length")
    )
    longest = max(job.response_lens())
    events = [e for e in job.scenario if e.response_len == longest and longest != job.response_len]
    if events:
        response_key = f"job.scenario (step {events[0].step}) response_len"
    return job.prompt_len + longest, f"{prompt_key} {job.prompt_len} + {response_key} {longest}"


def sequence_problem(cfg: NereusConfig) -> str | None:
    """Why a sequence the job can produce does not fit, or None: longer than a model's positions
    (``max_position_embeddings``; the config refuses its own lengths, a scenario event's longer
    responses are checked here), or than the token budget of a packed micro-batch
    (``passes.max_tokens_per_device``: a sequence is never split across micro-batches, as in verl's
    dynamic batching)."""
    tokens, parts = longest_sequence(cfg)
    positions, key = min(_positions(cfg))
    if tokens > positions:
        return (
            f"the job's longest sequence is {tokens} tokens ({parts}), more than {key}="
            f"{positions}; shorten the prompts or responses"
        )
    budget = cfg.passes.max_tokens_per_device
    if budget is not None and budget < tokens:
        return (
            f"passes.max_tokens_per_device={budget} is less than the job's longest sequence, {tokens} "
            f"tokens ({parts}); raise it to at least {tokens} or shorten the sequences"
        )
    return None


def _positions(cfg: NereusConfig) -> list[tuple[int, str]]:
    """(max_position_embeddings, the key that sets it) of each model the job runs."""
    models, used = cfg.models, {model_of(stage) for stage in cfg.stages}
    own = {"critic": ("critic.path", cfg.critic.path)}
    if cfg.reward is not None:
        own["reward"] = ("reward.model_path", cfg.reward.model_path)
    out = []
    for name in sorted(used):
        key, path = own.get(name, ("model", None))
        where = f"the {key} model's " if path is not None else "model."
        out.append((models[name].max_position_embeddings, f"{where}max_position_embeddings"))
    return out


def plan_memory_problem(cfg: NereusConfig) -> str | None:
    """Why the plan the run starts on (the config's plan, defaults for what it leaves out) does not fit
    ``cluster.memory_per_device``, by the memory model ``nereus plan`` and the controller use; or None.
    Checked whether or not ``job.adapt`` is on: the first step always runs on this plan. The line names
    the train stage whose memory choices (``Layout.memory_choices``: sharding over dp, recomputation,
    a pipeline's schedule) lower the busiest slot most, and the bytes with each."""
    plan = GlobalPlan.of(default_plan(cfg.plan, cfg.stages))
    capacity = int(cfg.cluster.memory_per_device)
    state = ControllerState.initial(cfg.models, get_profile(cfg.job.profile), stages=cfg.stages, plan=plan)
    usable = int(capacity * (1.0 - state.settings.headroom))
    workload = Workload.from_config(cfg)

    def peak(layouts: Mapping[str, Layout]) -> int:
        return evaluate_plan(GlobalPlan.of(layouts), workload, state, usable).memory_peak

    need = peak(plan.layouts)
    if need <= usable:
        return None
    fix = "raise it, spread the plan over more slots or shrink the batch"
    tried = {
        stage: [(other, peak({**plan.layouts, stage: other})) for other in layout.memory_choices()[1:]]
        for stage, layout in plan.layouts.items()
        if ModelStage(stage).trains
    }
    tried = {stage: options for stage, options in tried.items() if options}
    if tried:
        stage = min(tried, key=lambda s: min(b for _, b in tried[s]))
        each = ", ".join(f"{{{v.memory_choice()}}} {_size(b)}" for v, b in tried[stage])
        fix += f", or change {stage}'s memory choices (busiest slot with {each})"
    return (
        f"cluster.memory_per_device={_size(capacity)}: the initial plan {plan.plan_id} needs "
        f"{_size(need)} on its busiest slot, more than the {_size(usable)} usable "
        f"({state.settings.headroom:.0%} kept free); {fix} (nereus plan CONFIG shows plans that fit)"
    )


def predicted_slot_bytes(state: JobState) -> dict[int, int]:
    """Bytes each slot of the plan in force needs by the memory model (what ``nereus plan`` shows per
    device): the pool names a worker lost later with it, beside what was measured."""
    cfg = state.config
    plan = GlobalPlan.of(dict(state.layouts))
    estimate = evaluate_plan(
        plan, Workload.from_config(cfg), state.controller, int(cfg.cluster.memory_per_device)
    )
    return memory_per_device(plan, {s: e.memory for s, e in estimate.stages.items()})


def _local_slots(cfg: NereusConfig, devices: int | None) -> int:
    """The most slots a local cluster will have during the run: the start's, or a scenario event's."""
    return max([devices or cfg.cluster.devices] + [e.devices for e in cfg.job.scenario if e.devices])


def host_memory_problem(cfg: NereusConfig, machine: Machine) -> str | None:
    """Why the initial plan would not fit in this machine's memory on a local cluster, or None.

    Each slot of a local cluster is a worker process here; the plan needs the sum over its slots of
    what the memory model gives each (``nereus plan`` shows it). Past the memory available, the
    kernel kills workers mid-step (an 8B config on CPU died as "Worker ... was lost")."""
    if cfg.cluster.scheduler_address or machine.available_memory is None:
        return None
    plan = GlobalPlan.of(default_plan(cfg.plan, cfg.stages))
    state = ControllerState.initial(cfg.models, get_profile(cfg.job.profile), stages=cfg.stages, plan=plan)
    estimate = evaluate_plan(plan, Workload.from_config(cfg), state, int(cfg.cluster.memory_per_device))
    need = sum(memory_per_device(plan, {s: e.memory for s, e in estimate.stages.items()}).values())
    if need <= machine.available_memory:
        return None
    return (
        f"the initial plan {plan.plan_id} needs {_size(need)} over its device slots, more than the "
        f"{_size(machine.available_memory)} this machine has available, and a local cluster's slots "
        "are processes here; shrink the model or the batch, or give cluster.scheduler_address (workers "
        "on other machines)"
    )


def host_memory_warning(cfg: NereusConfig, machine: Machine, *, devices: int | None = None) -> str | None:
    """One line when ``cluster.memory_per_device`` times a local cluster's slots exceeds the memory
    available here, or None: plans the controller may switch to fill a slot up to that capacity, and
    the kernel kills a worker that takes more than the machine has (reported as lost, out of memory).
    A warning, not a refusal: the capacity is what the cost model counts, and the default's 2 GiB
    per slot is far more than a small model uses."""
    if cfg.cluster.scheduler_address or machine.available_memory is None:
        return None
    slots = _local_slots(cfg, devices)
    total = int(cfg.cluster.memory_per_device) * slots
    if total <= machine.available_memory:
        return None
    return (
        f"cluster.memory_per_device={_size(int(cfg.cluster.memory_per_device))} x {slots} local device "
        f"slots = {_size(total)}, more than the {_size(machine.available_memory)} available on this "
        "machine: a plan that fills its slots would get workers killed (out of memory); lower "
        "cluster.memory_per_device to what a slot may really use"
    )


def problems(
    cfg: NereusConfig, machine: Machine, *, devices: int | None = None, resume: bool = False
) -> list[str]:
    """Every bound ``cfg`` breaks on ``machine``, cheapest check first (empty if none).

    ``resume``: the run continues from a checkpoint whose plan the controller re-plans for the
    devices at hand, so the config's initial plan is not checked."""
    found = [
        sequence_problem(cfg),
        devices_problem(cfg, machine, devices=devices),
        batch_problem(cfg, machine),
    ]
    if not resume and not any(found):  # the plan checks assume sizes that fit a machine
        found.append(plan_memory_problem(cfg))
        if not any(found):
            found.append(host_memory_problem(cfg, machine))
    return [p for p in found if p]


def check(cfg: NereusConfig, machine: Machine, *, devices: int | None = None, resume: bool = False) -> None:
    """Raise ``ConfigError`` with the first of ``problems`` (one line), if any."""
    found = problems(cfg, machine, devices=devices, resume=resume)
    if found:
        raise ConfigError(found[0])


__all__ = [
    "BYTES_PER_VALUE",
    "DRIVER_MEMORY_SHARE",
    "LOCAL_SLOTS_PER_CPU",
    "ROLLOUT_TOKEN_COLUMNS",
    "Machine",
    "batch_problem",
    "check",
    "devices_problem",
    "host_memory_problem",
    "host_memory_warning",
    "longest_sequence",
    "plan_memory_problem",
    "problems",
    "rollout_bytes",
    "sequence_problem",
]
