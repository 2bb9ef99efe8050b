"""Which prompts each step trains on: seeded shuffling per epoch, batches, resume at any step.

The batch of step ``s`` is a pure function of (size, batch size, seed, s): epoch ``e = s // B``
(B batches per epoch) is a permutation of the rows drawn from ``SeedSequence([seed, e])`` and the
step takes its ``s % B``-th slice. So the same seed gives the same order, and a job resumed at step
``s`` trains on exactly the batch an uninterrupted run would have, without replaying earlier epochs.
(verl's dataloader seeds one generator once, so its epoch orders depend on the draws before them;
here each epoch has its own stream so that resuming needs no saved sampler state.)

Training drops the last partial batch of an epoch (verl's ``drop_last=True``): every step has the
same number of prompts. Validation (``shuffle=False, drop_last=False``) walks the rows in file
order with a short last batch. Boundary: integers in, row positions out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampler:
    """The batches of one split: row positions (into the split's examples after filtering)."""

    size: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch size {self.batch_size} must be at least 1")
        if self.size < (self.batch_size if self.drop_last else 1):
            raise ValueError(
                f"the split has {self.size} prompts, fewer than one batch of {self.batch_size}; "
                "add rows, lower the batch size or raise data.max_prompt_length"
            )

    @property
    def batches_per_epoch(self) -> int:
        whole, rest = divmod(self.size, self.batch_size)
        return whole + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The row positions of ``epoch`` in the order it visits them."""
        if epoch < 0:
            raise ValueError(f"epoch {epoch} must be >= 0")
        if not self.shuffle:
            return np.arange(self.size)
        generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
        return generator.permutation(self.size)

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, batch within the epoch)`` of ``step``."""
        if step < 0:
            raise ValueError(f"step {step} must be >= 0")
        return divmod(step, self.batches_per_epoch)

    def batch(self, step: int) -> list[int]:
        """The row positions step ``step`` trains on."""
        epoch, k = self.position(step)
        return self._slice(self.epoch_order(epoch), k)

    def batches(self, start_step: int = 0) -> Iterator[tuple[int, list[int]]]:
        """``(step, rows)`` from ``start_step`` on, drawing each epoch's order once."""
        epoch, k = self.position(start_step)
        step = start_step
        while True:
            order = self.epoch_order(epoch)
            for j in range(k, self.batches_per_epoch):
                yield step, self._slice(order, j)
                step += 1
            epoch, k = epoch + 1, 0

    def _slice(self, order: np.ndarray, k: int) -> list[int]:
        return [int(i) for i in order[k * self.batch_size : (k + 1) * self.batch_size]]


__all__ = ["Sampler"]
