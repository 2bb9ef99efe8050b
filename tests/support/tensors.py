"""Tensor comparisons the tests share."""

from __future__ import annotations

import torch


def close(a: torch.Tensor, b: torch.Tensor | list[float]) -> None:
    """``a`` equals ``b`` within 1e-6 absolute (``b`` cast to ``a``'s dtype)."""
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=0, atol=1e-6)
