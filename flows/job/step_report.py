"""Rendering of one step's timed rows (metrics/steps.parquet) as a readable table (for the run logger
and the terminal)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def step_table(rows: Sequence[dict[str, Any]], stats: dict[str, Any]) -> str:
    """A plain aligned table: one line per timed row (a model's stage) with its share of the step, then
    the totals."""
    wall = stats["wall_s"]
    lines = [f"{'model':<10} {'stage':<11} {'seconds':>8} {'share':>6} {'tokens':>7}"]
    for r in rows:
        share = r["duration_s"] / wall if wall else 0.0
        # A pass skipped because its result equals one the step has (old log-probs with one update).
        seconds = f"{'reused':>8} {'':>6}" if r.get("reused") else f"{r['duration_s']:>8.3f} {share:>6.1%}"
        lines.append(f"{r['model']:<10} {r['stage']:<11} {seconds} {r['tokens']:>7}")
    lines.append(
        f"{'step':<10} {'wall':<11} {wall:>8.3f}   overhead {stats['overhead_s']:.3f} s "
        f"({stats['overhead_s'] / wall:.1%}) | score {stats['score']:.3f} rule {stats['rule_score']:.3f}"
        + (f" | kl {stats['kl']:.4f}" if "kl" in stats else "")  # no reference model: no KL
    )
    phases = [k[len("phase_") : -len("_s")] for k in stats if k.startswith("phase_") and k.endswith("_s")]
    if phases:  # each phase's wall: its slot groups ran at once, one group's rows in turn
        parts = []
        for kind in phases:
            pools = stats.get(f"phase_{kind}_pools", 1)
            at_once = f" ({pools} pools at once)" if pools > 1 else ""
            parts.append(f"{kind} {stats[f'phase_{kind}_s']:.3f} s{at_once}")
        lines.append(f"{'phases':<10} " + " | ".join(parts))
    if "actor_loss" in stats:  # the statistics verl logs (pg_clipfrac, ppo_kl, entropy, grad_norm, ...)
        parts = [
            f"actor loss {stats['actor_loss']:.4f} clip {stats['actor_clip_frac']:.3f} "
            f"kl {stats['actor_approx_kl']:.2e} entropy {stats['actor_entropy']:.3f} "
            f"grad {stats['actor_grad_norm']:.3f}"
        ]
        if "critic_loss" in stats:  # a job with a critic
            parts.append(
                f"critic loss {stats['critic_loss']:.4f} vclip {stats['critic_value_clip_frac']:.3f} "
                f"grad {stats['critic_grad_norm']:.3f}"
            )
        parts.append(
            f"response len {stats['response_len_mean']:.1f} max {stats['response_len_max']:.0f} "
            f"at limit {stats['response_clip_frac']:.0%}"
        )
        lines.append(" | ".join(parts))
    return "\n".join(lines)
