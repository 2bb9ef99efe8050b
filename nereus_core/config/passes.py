"""The passes section: how forward passes and training lay out their sequences.

``pack: true`` (verl's ``use_remove_padding``) runs every forward pass (reward, reference, critic
values, the actor's old log-probs) and every train step on the real tokens only: the sequences of a
micro-batch are packed into one row, positions restart per sequence and attention stays inside each
sequence; the outputs come back as the padded per-sequence tensors they replace.
``max_tokens_per_device`` (verl's ``ppo_max_token_len_per_gpu`` with ``use_dynamic_bsz``) cuts a
replica's rows into micro-batches of at most that many real tokens instead of the layout's
``micro_batches`` equal slices; the loss stays the token-mean over the mini-batch.

Boundary: what the section may hold. The engine (``engine.packing``) does the packing; the memory
model counts a packed micro-batch's real tokens (``cost.terms.pass_rows``); a budget under the job's
longest sequence is refused before anything starts (``preflight.sequence_problem``): the section
alone does not know the job's lengths.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from nereus_core.frozen import Frozen

# verl's names for the same settings (actor, critic and log-prob passes share one budget here).
ALIASES = {
    "use_remove_padding": "pack",
    "ppo_max_token_len_per_gpu": "max_tokens_per_device",
    "log_prob_max_token_len_per_gpu": "max_tokens_per_device",
}


class PassesConfig(Frozen):
    """Packing and token-budget micro-batches of the forward and train passes."""

    pack: bool = Field(
        default=True,
        description="Pack each micro-batch's real tokens into one row (no padding computed), as verl's "
        "use_remove_padding; results equal the padded passes within rounding. A batch without "
        "padding or budget runs as it is.",
    )
    max_tokens_per_device: int | None = Field(
        default=None,
        ge=1,
        le=16 * 1024 * 1024,
        description="Real tokens per micro-batch on one device (verl's ppo_max_token_len_per_gpu); "
        "None: the layout's micro_batches equal slices. Needs pack: true and at least the job's longest "
        "sequence (prompt + response).",
    )

    @model_validator(mode="before")
    @classmethod
    def _verl_names(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for alias, name in ALIASES.items():
            if alias in out:
                value = out.pop(alias)
                if name in out and out[name] != value:
                    raise ValueError(
                        f"passes.{alias}={value} and passes.{name}={out[name]} disagree; give one of them"
                    )
                out[name] = value
        return out

    @model_validator(mode="after")
    def _budget_needs_packing(self) -> PassesConfig:
        if self.max_tokens_per_device is not None and not self.pack:
            raise ValueError(
                f"passes.max_tokens_per_device={self.max_tokens_per_device} needs passes.pack: true "
                "(token-budget micro-batches are packed); set pack: true or drop the budget"
            )
        return self
