"""What ``nereus plan CONFIG`` prints: the plan the controller would pick, its predicted step time
and memory per slot, the config's own plan, the disk its checkpoints take, and the rejected
alternatives with the reason for each.

The decision itself is ``nereus_core.controller.decide.decide``; this module only formats it for a terminal
(or a pipe: flows/cli/main.py ends a closed pipe quietly).
"""

from __future__ import annotations

from typing import Any

from flows.cli.plan_why import why_lines
from nereus_core.config import NereusConfig


def print_plan(cfg: NereusConfig, *, profile: str) -> int:
    """Print the plan the controller picks for ``cfg`` on the ``profile`` hardware, its predicted
    cost and the runners-up; the exit status (1 when no plan fits)."""
    from nereus_core.controller.decide import ControllerState, Observation, decide
    from nereus_core.cost.hardware import get_profile
    from nereus_core.job import controller_settings
    from nereus_core.plan import GlobalPlan, default_plan

    hardware = get_profile(profile)
    settings = controller_settings(cfg)  # as the job's own controller weighs plans
    obs = Observation.before_start(cfg)
    fresh = ControllerState.initial(cfg.models, hardware, settings, stages=cfg.stages)
    decision = decide(obs, fresh)
    print(_plan_header(cfg, hardware.name, obs, fresh.settings.headroom))
    if decision.chosen is None:
        print(f"no plan fits: {decision.reason}")
    else:
        print(_plan_table(decision.chosen))
        print("\n".join(why_lines(decision.chosen, obs.workload, fresh)))
    initial = GlobalPlan.of(default_plan(cfg.plan, cfg.stages))  # the plan `nereus run` starts on
    if decision.chosen is not None and initial != decision.chosen.plan:
        started = ControllerState.initial(
            cfg.models, hardware, settings, stages=cfg.stages, plan=initial, devices=obs.devices
        )
        from_config = decide(obs, started)
        current = from_config.current
        where = f"step {current.step_s:.4g} s, {current.memory_peak / 2**30:.3f} GiB/slot" if current else ""
        print(f"\nconfig plan {initial.plan_id} ({initial.placement}): {where}")
        print(f"  a job started on it would {from_config.action}: {from_config.reason}")
    print(f"\n{checkpoint_line(cfg)}")
    if decision.alternatives:
        print("\nrejected alternatives")
        for alt in decision.alternatives:
            gib = alt.memory_peak / 2**30
            print(f"  {alt.plan_id}  step {alt.step_s:9.4g} s  {gib:7.2f} GiB/slot  {alt.reason}")
            print(f"      {alt.description}")
            print(f"      why: {alt.detail}")
    return 0 if decision.chosen is not None else 1


def checkpoint_bytes(cfg: NereusConfig) -> dict[str, int]:
    """Bytes one checkpoint writes per model: every tensor of the stage holding its state as its shard
    map sizes it (parameters in ``model.dtype``; a train stage's fp32 AdamW moments, master weights and
    step count too), each box written once whatever the layout. Arrow's framing (under a KiB a tensor
    slice) is not counted."""
    from nereus_core.emu import shard_map
    from nereus_core.plan import default_plan, state_stages

    layouts = default_plan(cfg.plan, cfg.stages)
    models = cfg.models
    return {
        model: sum(t.nbytes for t in shard_map(models[model], layouts[stage], train=stage.trains).tensors)
        for model, stage in state_stages(cfg.stages).items()
    }


def checkpoint_line(cfg: NereusConfig) -> str:
    """The disk a run's checkpoints take: one checkpoint's bytes per model, and the most the run
    directory holds at once under ``job.keep_checkpoints`` (the next one is complete before the oldest
    goes), or, keeping all, by the end."""
    per_model = checkpoint_bytes(cfg)
    one = sum(per_model.values())
    job = cfg.job
    parts = ", ".join(f"{model} {_size(n)}" for model, n in per_model.items())
    every = f"every {job.snapshot_every} steps and at the end" if job.snapshot_every else "at the end"
    written = (len(range(job.snapshot_every, job.steps, job.snapshot_every)) if job.snapshot_every else 0) + 1
    if job.keep_checkpoints:
        held = min(job.keep_checkpoints + 1, written)
        kept = f"the newest {job.keep_checkpoints} kept: at most {held} at once, {_size(held * one)}"
    else:
        kept = f"all kept: {written} by the end, {_size(written * one)}, each plan switch adds one"
    return f"checkpoints: {_size(one)} each ({parts}); {every}; {kept}"


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _plan_header(cfg: NereusConfig, profile: str, obs: Any, headroom: float) -> str:
    gib = obs.memory_per_device / 2**30
    w = obs.workload
    return (
        f"nereus plan: {cfg.name} on {obs.devices} slots x {gib:.2f} GiB ({profile} profile, "
        f"{headroom:.0%} headroom)\nworkload: batch {w.batch}, prompt {w.prompt_len}, "
        f"response mean {w.response_mean:g} (high {w.response_high})"
        + passes_line(w)
        + (
            "\ntrain passes: gradient checkpointing (each layer's input kept, one more forward)"
            if cfg.model.gradient_checkpointing
            else ""
        )
    )


def passes_line(workload: Any) -> str:
    """What the memory model counts of a packed pass (``passes``), as a line of its own; empty for
    padded passes, whose output stays as it was."""
    if not workload.pack:
        return ""
    budget = workload.max_tokens_per_device
    if budget is None:
        return "\npasses: packed; a micro-batch's activations counted at its real tokens (rows x mean length)"
    return (
        f"\npasses: packed, max_tokens_per_device {budget}: a micro-batch's activations counted at "
        f"its real tokens, at most {budget} per device"
    )


def describe_phases(layouts: Any, seconds: dict[str, float]) -> str:
    """``generate 1.2 s [actor/generate] ; infer 0.8 s [critic/infer] | [reference/infer] ; ...``:
    each phase's time and its pools (``|``: pools that run at once, on disjoint slots)."""
    from nereus_core.cost.plan_estimate import phase_seconds
    from nereus_core.plan import phases

    times = phase_seconds(layouts, seconds)
    parts = []
    for kind, pools in phases(layouts).items():
        pooled = " | ".join("[" + ", ".join(pool) + "]" for pool in pools)
        parts.append(f"{kind} {times[kind]:.4g} s {pooled}")
    return " ; ".join(parts)


def _plan_table(chosen: Any) -> str:
    plan = chosen.plan
    lines = [
        f"\nchosen {plan.plan_id}  {plan.placement}  step {chosen.step_s:.4g} s "
        f"(weight sync {chosen.sync_s:.3g} s)",
        f"  {'model-stage':<16} {'tp':>3} {'pp':>3} {'dp':>4} {'mb':>4} {'sched':>5} {'rc':>3} {'shard':>5}  "
        f"{'slots':<12} {'latency s':>10} {'GiB/slot':>9}",
    ]
    for stage, layout in plan.layouts.items():
        est = chosen.stages[stage]
        slots = f"{layout.devices[0]}..{layout.devices[-1]}"
        train = stage.endswith("/train")
        schedule = layout.schedule if layout.pp > 1 and train else "-"
        recompute = ("yes" if layout.recompute else "no") if train else "-"
        shard = ("full" if layout.shard == "full" else "opt") if train else "-"
        lines.append(
            f"  {stage:<16} {layout.tp:>3} {layout.pp:>3} {layout.dp:>4} {layout.micro_batches:>4} "
            f"{schedule:>5} {recompute:>3} {shard:>5}  {slots:<12} {est.seconds:>10.4g} "
            f"{est.memory.total / 2**30:>9.3f}"
        )
    lines.append(
        f"  phases: {describe_phases(plan.layouts, {s: e.seconds for s, e in chosen.stages.items()})}"
    )
    lines.append(
        f"  busiest slot: {chosen.memory_peak / 2**30:.3f} GiB of {chosen.usable / 2**30:.2f} GiB usable"
    )
    return "\n".join(lines)
