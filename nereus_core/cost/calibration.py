"""Calibration: per-term scale factors of the cost model, fitted to what the running job measures.

Boundary: samples in (the unscaled term breakdown the cost model predicted for a
stage run, and the seconds it took), scales out. Nothing here knows stages or
layouts; the controller turns observations into samples and refits from all of
them every step.

The fit (a ridge regression on log time, robust to outliers):

    minimize  sum_i w_i * (log(sum_k s_k * t_ik) - log(y_i))^2  +  prior * sum_k log(s_k)^2

over theta = log(s): log because stage times span orders of magnitude and errors
are relative; the Gaussian prior at log(s) = 0 keeps terms the data cannot
separate at the analytic model (a term that is zero in every sample stays at 1),
and lets a few samples move the scales only as far as they are evidence for it.
Outliers (residuals beyond max(huber, 3 MAD) after a first fit) are down-weighted
with Huber weights and the fit redone, so a single wild timing does not drag it.
Solved by damped Gauss-Newton (Levenberg-Marquardt); the Jacobian of a log-sum is
each term's share of the prediction. Scales are clipped to
[min_scale, max_scale].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class CalibrationSettings(BaseModel):
    """How strongly the prior holds and how the fit treats outliers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prior: float = Field(
        default=0.05,
        ge=0,
        le=1e6,
        description="Ridge weight on each log(scale) (a prior at scale 1); one sample weighs 1.",
    )
    huber: float = Field(
        default=0.15,
        gt=0,
        le=10,
        description="Residuals (in log time) beyond this count linearly, not squared.",
    )
    min_scale: float = Field(default=1e-3, gt=0, description="Smallest scale the fit may return.")
    max_scale: float = Field(default=1e3, gt=1, description="Largest scale the fit may return.")
    max_samples: int = Field(
        default=512, ge=1, le=100_000, description="Most recent samples kept for refits."
    )
    iterations: int = Field(default=30, ge=1, le=1000, description="Gauss-Newton iterations per fit.")


class Sample(NamedTuple):
    """One measured run: the unscaled predicted seconds of each term and the seconds it took."""

    terms: tuple[float, ...]
    seconds: float
    weight: float = 1.0


def _objective(theta: np.ndarray, t: np.ndarray, log_y: np.ndarray, w: np.ndarray, prior: float) -> float:
    r = np.log(np.maximum(t @ np.exp(theta), 1e-300)) - log_y
    return float(0.5 * (w * r * r).sum() + 0.5 * prior * (theta * theta).sum())


def _least_squares(
    theta: np.ndarray, t: np.ndarray, log_y: np.ndarray, w: np.ndarray, cfg: CalibrationSettings
) -> np.ndarray:
    """Weighted ridge least squares on log time, by damped Gauss-Newton (Levenberg-Marquardt)."""
    k = t.shape[1]
    lo, hi = np.log(cfg.min_scale), np.log(cfg.max_scale)
    damping, current = 1e-3, _objective(theta, t, log_y, w, cfg.prior)
    for _ in range(cfg.iterations):
        contrib = t * np.exp(theta)  # [n, k]
        pred = contrib.sum(axis=1)
        jac = contrib / pred[:, None]  # d log(pred) / d theta_k: each term's share of the prediction
        r = np.log(pred) - log_y
        grad = jac.T @ (w * r) + cfg.prior * theta
        hess = jac.T @ (w[:, None] * jac) + cfg.prior * np.eye(k)
        step = np.zeros(k)
        while damping < 1e8:
            step = np.linalg.solve(hess + damping * np.eye(k), -grad)
            trial = np.clip(theta + step, lo, hi)
            value = _objective(trial, t, log_y, w, cfg.prior)
            if value < current:
                theta, current, damping = trial, value, max(damping / 10, 1e-9)
                break
            damping *= 10
        else:
            break
        if np.abs(step).max() < 1e-8:
            break
    return theta


def fit_scales(
    samples: Sequence[Sample],
    settings: CalibrationSettings | None = None,
    *,
    start: Sequence[float] | None = None,
) -> np.ndarray:
    """Scale per term that best explains ``samples`` (ones when there are none).

    Robustness: a least-squares fit first; then samples whose residual exceeds
    ``max(huber, 3 * MAD)`` of the residuals get Huber weights ``cut / |r|`` and the fit
    is redone. A systematic error of the prior (every sample off by 3x) is thus fitted
    in full, while a few wild timings barely move it.
    """
    cfg = settings or CalibrationSettings()
    samples = [s for s in samples[-cfg.max_samples :] if s.seconds > 0 and sum(s.terms) > 0]
    if not samples:
        return np.ones(len(start) if start is not None else 0)
    t = np.array([s.terms for s in samples], dtype=float)
    log_y = np.log([s.seconds for s in samples])
    w = np.array([s.weight for s in samples], dtype=float)
    theta = np.zeros(t.shape[1]) if start is None else np.log(np.asarray(start, dtype=float))
    theta = _least_squares(theta, t, log_y, w, cfg)
    r = np.abs(np.log(t @ np.exp(theta)) - log_y)
    cut = max(cfg.huber, 3.0 * 1.4826 * float(np.median(np.abs(r - np.median(r)))))
    if (r > cut).any():
        theta = _least_squares(theta, t, log_y, w * np.minimum(1.0, cut / np.maximum(r, 1e-12)), cfg)
    return np.exp(theta)


def relative_errors(samples: Sequence[Sample], scales: Sequence[float]) -> np.ndarray:
    """|predicted - measured| / measured of each sample under ``scales``."""
    t = np.array([s.terms for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    return np.abs(t @ np.asarray(scales, dtype=float) - y) / y
