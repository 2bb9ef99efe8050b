"""Loading a model-stage from a Hugging Face model directory: each device reads only its own slices.

It is the device path of rehydrating a snapshot (``engine.reshard.durable_read``: build the new
shard, read exactly this device's boxes, install them), with the model directory as a read-only
``StateStore``: every parameter box is read memory-mapped from the safetensors
(``hf.files.read_slices``), so the full model never passes through the driver or through any one
device. A train stage starts as a fresh optimizer would: zero AdamW moments, step 0.

Which directory each model reads (``hf_source``):
- actor and reference: ``model.path`` (a ``*ForCausalLM``);
- critic: ``critic.path`` (a one-label ``*ForSequenceClassification`` / ``*ForTokenClassification``:
  backbone and ``score.weight``), else ``model.path``'s backbone with a fresh value head, as verl
  builds its critic (``AutoModelForTokenClassification.from_pretrained(actor path, num_labels=1)``:
  the head is new, drawn as Hugging Face's ``_init_weights`` draws a linear, normal(0, std) with
  ``std`` = ``model.init_std``, HF's ``initializer_range`` default 0.02), seeded by ``model.seed``
  so that every device and every copy draws the same head;
- reward: ``reward.model_path`` (a one-label ``*ForSequenceClassification`` of its own shapes, read
  as the critic's directory is), else none here: it is fitted to the count task's rule.

Boundary: device-side functions over one ``DeviceContext`` and the pure rule of which directory a
model reads; the pool in tasks/ runs ``load_from_hf`` on a layout's devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nereus_core.config import ModelConfig, NereusConfig
from nereus_core.emu import Box, SliceSpec, split_state_name
from nereus_core.engine.device import DeviceContext
from nereus_core.engine.reshard import ReshardJob, durable_read
from nereus_core.hf.files import read_slices
from nereus_core.model.weights import SCORE


@dataclass(frozen=True)
class HFSource:
    """A model directory to load from; ``fresh_head``: the value head is drawn, not read."""

    path: str
    fresh_head: bool = False


def hf_source(config: NereusConfig, model: str) -> HFSource | None:
    """The directory ``model`` (actor, critic, reference, reward) loads from, or None (seeded or fitted)."""
    if model == "critic" and config.critic.path is not None:
        return HFSource(config.critic.path)
    if model == "reward":
        path = config.reward.model_path if config.reward is not None else None
        return None if path is None else HFSource(path)
    if config.model.path is None:
        return None
    return HFSource(config.model.path, fresh_head=model == "critic")


def fresh_value_head(config: ModelConfig) -> torch.Tensor:
    """The new value head ``score.weight`` ``[1, hidden]``: normal(0, init_std), seeded by ``config.seed``."""
    generator = torch.Generator(device="cpu").manual_seed(config.seed)
    return torch.empty(1, config.hidden_size).normal_(0.0, config.init_std, generator=generator)


@dataclass
class HFDirStore:
    """A model directory as the ``StateStore`` a device reads its boxes from (read-only).
    ``file_bytes``: the bytes this store copied out of the directory's files so far."""

    source: HFSource
    config: ModelConfig
    file_bytes: int = field(default=0)

    def write_pieces(self, device: int, pieces: Sequence[tuple[str, torch.Tensor, SliceSpec]]) -> Any:
        raise TypeError(f"{self.source.path} is a model directory to import from; nothing is written to it")

    def read_pieces(self, wanted: Sequence[tuple[str, Box]]) -> list[torch.Tensor]:
        """Parameter boxes from the files (a fresh head drawn instead, if asked), optimizer state zero."""
        from_files: dict[str, tuple[slice, ...]] = {}
        out: dict[tuple[str, Box], torch.Tensor] = {}
        for name, box in wanted:
            kind = split_state_name(name)[1]
            if kind != "param":
                out[(name, box)] = torch.zeros(box.shape, dtype=torch.float32)  # a fresh optimizer's
            elif name == SCORE and self.source.fresh_head:
                out[(name, box)] = fresh_value_head(self.config)[box.slices()]
            elif name in from_files:
                raise ValueError(f"{name}: two boxes wanted from one device; a device holds one shard")
            else:
                from_files[name] = box.slices()
        read = read_slices(self.source.path, from_files) if from_files else {}
        self.file_bytes += sum(t.numel() * t.element_size() for t in read.values())
        for name, box in wanted:
            out.setdefault((name, box), read.get(name))  # type: ignore[arg-type]
        return [out[key] for key in wanted]


def load_from_hf(ctx: DeviceContext, *, job: ReshardJob, source: HFSource) -> dict[str, float]:
    """Make ``job.name`` resident on this device of ``job.new_map``'s layout (groups built), its boxes
    read from ``source``; returns seconds (read, install) and ``file_bytes`` read from the files."""
    store = HFDirStore(source, job.config)
    figures = durable_read(ctx, job=job, store=store)
    return {**figures, "file_bytes": float(store.file_bytes)}
