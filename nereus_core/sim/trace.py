"""A trace: what the cluster and the data do to a job (PPO or GRPO), step by step.

Boundary: CSV text in (the caller reads the file), a validated ``Trace`` out.
Each step gives the devices available, the usable memory per device (memory
pressure events lower it), the batch (the step's sequences: prompts x responses per
prompt, a GRPO job's ``group_size``), the mean prompt length, and the response-length
distribution (mean, p90, max). How the shipped traces were derived from public
data is in data/traces/README.md and data/traces/build_traces.py.

Columns: ``step, devices, capacity_gb, batch, prompt_len, response_mean, response_p90,
response_max``; ``devices`` may be left out when the caller fixes it; columns named
``src_*`` (provenance) and any others are ignored.

How devices leave (``shrinks``, the trace's, set by its config): ``planned`` (a lease that ends: the
job knows the step and may write before the devices go) or ``unplanned`` (preemption or failure:
the devices are gone after the step, and every strategy restarts from its newest checkpoint,
rerunning the steps since it).
"""

from __future__ import annotations

import csv
import hashlib
import io
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from nereus_core.config import PassesConfig, Workload

GB = 10**9
Shrinks = Literal["planned", "unplanned"]
REQUIRED = ("step", "capacity_gb", "batch", "prompt_len", "response_mean", "response_p90", "response_max")

# Every strategy's passes run packed: Nereus's runtime by default (``passes.pack``), verl with
# ``use_remove_padding``, OpenRLHF with ``--packing_samples``; the world counts real tokens too.
PACKED = PassesConfig.model_fields["pack"].default


class TraceError(ValueError):
    """A trace file is malformed; ``str(err)`` is one line naming the row and column."""


COLUMNS = ("devices", "capacity_gb", "batch", "prompt_len", "response_mean", "response_p90", "response_max")


@dataclass(frozen=True)
class Trace:
    """Per-step arrays of one trace (all the same length)."""

    name: str
    devices: np.ndarray
    capacity_gb: np.ndarray
    batch: np.ndarray
    prompt_len: np.ndarray
    response_mean: np.ndarray
    response_p90: np.ndarray
    response_max: np.ndarray
    ppo_epochs: int = 1
    shrinks: Shrinks = "planned"

    def digest(self) -> str:
        """A hash of every column's values: two traces with the same digest replay the same steps."""
        h = hashlib.sha256(f"{self.name}/{self.ppo_epochs}/{self.shrinks}".encode())
        for field in COLUMNS:
            column = np.ascontiguousarray(getattr(self, field))
            h.update(f"{field}:{column.dtype}:".encode() + column.tobytes())
        return h.hexdigest()[:16]

    def __post_init__(self) -> None:
        n = len(self.devices)
        if n == 0:
            raise TraceError(f"trace {self.name}: no steps")
        for field in COLUMNS[1:]:
            if len(getattr(self, field)) != n:
                raise TraceError(
                    f"trace {self.name}: column {field} has {len(getattr(self, field))} rows, not {n}"
                )

    @property
    def steps(self) -> int:
        return len(self.devices)

    def unplanned_shrink(self, k: int) -> bool:
        """Whether devices are lost without notice after step ``k`` (fewer at ``k + 1``)."""
        return self.shrinks == "unplanned" and k + 1 < self.steps and self.devices[k + 1] < self.devices[k]

    def memory_bytes(self, k: int) -> int:
        return int(self.capacity_gb[k] * GB)

    @cached_property
    def workloads(self) -> tuple[Workload, ...]:
        """The workload of every step (time uses the mean response, memory the p90)."""
        return tuple(
            Workload(
                batch=int(self.batch[k]),
                prompt_len=int(self.prompt_len[k]),
                response_mean=float(self.response_mean[k]),
                response_high=max(int(self.response_p90[k]), int(np.ceil(self.response_mean[k]))),
                response_max=max(
                    int(self.response_max[k]), int(self.response_p90[k]), int(np.ceil(self.response_mean[k]))
                ),
                ppo_epochs=self.ppo_epochs,
                pack=PACKED,
            )
            for k in range(self.steps)
        )

    def tokens(self, k: int) -> float:
        """Tokens a step processes: every sequence's prompt and (mean) response."""
        return float(self.batch[k]) * (float(self.prompt_len[k]) + float(self.response_mean[k]))

    def expected(self, k: int, window: int) -> Workload:
        """What a job that has run steps ..k expects next: lengths of its last ``window`` steps."""
        lo = max(0, k - window + 1)
        mean = float(self.response_mean[lo : k + 1].mean())
        high = max(int(self.response_p90[lo : k + 1].max()), int(np.ceil(mean)))
        return Workload(
            batch=int(self.batch[k]),
            prompt_len=round(float(self.prompt_len[lo : k + 1].mean())),
            response_mean=mean,
            response_high=high,
            response_max=max(int(self.response_max[lo : k + 1].max()), high),
            ppo_epochs=self.ppo_epochs,
            pack=PACKED,
        )


def _number(text: str, row: int, column: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise TraceError(f"row {row}, column {column}: {text!r} is not a number") from None


def parse_trace(
    text: str,
    *,
    name: str,
    devices: int | None = None,
    steps: int | None = None,
    shrinks: Shrinks = "planned",
) -> Trace:
    """A ``Trace`` from CSV text; ``devices`` replaces the devices column, ``steps`` keeps the first N."""
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    need = REQUIRED if devices is not None else ("devices", *REQUIRED)
    missing = [c for c in need if c not in header]
    if missing:
        raise TraceError(f"trace {name}: missing column(s) {', '.join(missing)}; it has {', '.join(header)}")
    cols: dict[str, list[float]] = {c: [] for c in need}
    for i, row in enumerate(reader, start=2):
        if steps is not None and len(cols["step"]) >= steps:
            break
        for c in need:
            cols[c].append(_number(row[c], i, c))
    if steps is not None and len(cols["step"]) < steps:
        raise TraceError(f"trace {name}: asked for {steps} steps but the file has {len(cols['step'])}")
    arr = {c: np.asarray(v) for c, v in cols.items()}
    if not len(arr["step"]) or not np.array_equal(arr["step"], np.arange(len(arr["step"]))):
        raise TraceError(f"trace {name}: column step must count 0, 1, 2, ... from the first row")
    dev = np.full(len(arr["step"]), devices) if devices is not None else arr["devices"]
    checks = (
        ("devices", dev, 1),
        ("capacity_gb", arr["capacity_gb"], 1e-9),
        ("batch", arr["batch"], 1),
        ("prompt_len", arr["prompt_len"], 1),
        ("response_mean", arr["response_mean"], 1e-9),
    )
    for column, values, low in checks:
        bad = np.flatnonzero(values < low)
        if bad.size:
            raise TraceError(
                f"trace {name}: step {bad[0]}, column {column}={values[bad[0]]:g} is below {low:g}"
            )
    disordered = (arr["response_p90"] < arr["response_mean"]) | (arr["response_max"] < arr["response_p90"])
    if disordered.any():
        k = int(np.flatnonzero(disordered)[0])
        raise TraceError(f"trace {name}: step {k}: response lengths must satisfy mean <= p90 <= max")
    return Trace(
        name=name,
        devices=dev.astype(np.int64),
        capacity_gb=arr["capacity_gb"],
        batch=arr["batch"].astype(np.int64),
        prompt_len=arr["prompt_len"].astype(np.int64),
        response_mean=arr["response_mean"],
        response_p90=arr["response_p90"].astype(np.int64),
        response_max=arr["response_max"].astype(np.int64),
        shrinks=shrinks,
    )
