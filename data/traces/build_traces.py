"""Derive the simulator's trace CSVs (data/traces/) from the project's public data set (JSON summary out).

The input is the source data folder these traces were cut from (``cluster/``,
``rl_length/``, ``lengths/``: public cluster traces, verl's per-stage PPO logs and response-length
curves, each documented with its source in that folder's README.md; not shipped); give its path. Nothing
here is random except the prompt sample, which
is seeded, so the output is the same on every run. What each column is taken
from, and how it is scaled, is written into data/traces/README.md; in short:

- devices (grow_1024.csv): Helios "Earth" VC ``vc3sl`` (64 GPUs), the minimum of its
  idle GPUs over the hour after each step (a one-hour lease: GPUs the elastic job can
  hold), from 2020-05-01 00:00, one step per 8 minutes; scaled x16 (a 64-GPU VC
  -> a 1,024-GPU one), at least 16 (the job's own two nodes), rounded down to a
  power of two (the 8,192-sequence batch splits evenly only over power-of-two
  data-parallel degrees, so an elastic job takes GPUs in doublings).
- response lengths: Open-Reasoner-Zero's mean response length per PPO step
  (ORZ-32B for the 1,000-step run, ORZ-7B for the fixed-size runs), digitised from
  the paper's figure; p90 and max from the shape of MATH500 reference solutions
  (p90/mean, p99/mean), capped at DAPO's 20,480-token generation limit.
- prompt lengths: the mean of 128 MATH500 problems drawn per step (ORZ's 128 prompts),
  at 4 characters per token, plus the chat-template overhead measured in verl's
  GSM8K PPO logs (prompt tokens minus question characters / 4).
- capacity_gb: 80 (H100 SXM). No GPU-memory time series of an RL job is public
  (the data README says so); the two reduced-capacity windows of grow_1024.csv are
  an assumption, not data.
- devices (churn_median.csv, churn_p90.csv): a job that borrows idle GPUs without a lease and loses
  them when the scheduler hands them to other jobs. Every 1,000-step window (one step per 8 minutes,
  a window starting at each day's midnight) of every Helios Earth VC and of the Philly cluster: the
  free share of the cluster over the step's 8 minutes (the minimum; Helios: idle GPUs over the VC's
  GPUs; Philly: total minus active nodes over total nodes), times 1,024, at least 16, rounded down to
  a power of two. The windows are ranked by their device changes; the one at the median and the one
  at the 90th percentile are written (the first such window in source order).

    python data/traces/build_traces.py SHARED_DATA_DIR [--out data/traces]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
from pathlib import Path

import numpy as np

BATCH = 128 * 64  # ORZ: 128 prompts x 64 responses per PPO step (data README, section 2b)
CHARS_PER_TOKEN = 4.0  # "the usual rule of about 4 characters per English token" (data README, section 3)
MAX_RESPONSE = 20_480  # DAPO's maximum generation length, 16,384 + 4,096 (data README, section 2b)
GROW_STEPS = 1000
STEP_MINUTES = 8  # trace minutes per PPO step of the growth run
LEASE_MINUTES = 60
VC = "vc3sl"
TARGET_GPUS = 1024
MIN_GPUS = 16
PRESSURE = ((300, 340, 60.0), (700, 740, 60.0))  # (first step, end step, usable GB): an assumption


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def pow2_floor(x: float) -> int:
    return 1 << int(np.floor(np.log2(x)))


def availability(data: Path) -> tuple[list[int], list[int], list[int]]:
    """Devices per step of the growth run, with the source minute and idle count of each step."""
    rows = read_csv(data / "cluster" / "helios_earth_vc_idle_gpus_5min.csv")
    capacity = {
        r["vc"]: int(r["total_gpus"])
        for r in read_csv(data / "cluster" / "helios_earth_vc_capacity_2020-05.csv")
    }
    idle = np.array([int(r[VC]) for r in rows])
    minute0 = int(rows[0]["minute"])
    scale = TARGET_GPUS / capacity[VC]
    devices, minutes, leased = [], [], []
    for k in range(GROW_STEPS):
        minute = minute0 + k * STEP_MINUTES
        first = (minute - minute0) // 5
        free = int(idle[first : first + LEASE_MINUTES // 5].min())
        devices.append(pow2_floor(min(TARGET_GPUS, max(MIN_GPUS, free * scale))))
        minutes.append(minute)
        leased.append(free)
    return devices, minutes, leased


def free_shares(data: Path) -> dict[str, np.ndarray]:
    """Per 5-minute row, the free share of each Helios Earth VC and of the Philly cluster."""
    rows = read_csv(data / "cluster" / "helios_earth_vc_idle_gpus_5min.csv")
    capacity = {
        r["vc"]: int(r["total_gpus"])
        for r in read_csv(data / "cluster" / "helios_earth_vc_capacity_2020-05.csv")
    }
    out = {f"helios/{vc}": np.array([int(r[vc]) for r in rows]) / total for vc, total in capacity.items()}
    philly = read_csv(data / "cluster" / "philly_nodes_5min.csv")
    total = np.array([float(r["total_nodes_min"]) for r in philly])
    active = np.array([float(r["active_nodes_max"]) for r in philly])
    out["philly"] = np.clip((total - active) / total, 0.0, 1.0)
    return out


def borrowed(share: np.ndarray, first: int) -> list[int]:
    """Devices per step of a 1,000-step window from 5-minute row ``first``: no lease."""
    out = []
    for k in range(GROW_STEPS):
        row = first + k * STEP_MINUTES // 5
        free = float(share[row : row + max(1, STEP_MINUTES // 5)].min())
        out.append(pow2_floor(min(TARGET_GPUS, max(MIN_GPUS, free * TARGET_GPUS))))
    return out


def churn_windows(data: Path) -> tuple[dict[str, tuple[str, int, list[int]]], dict]:
    """The windows at the median and the 90th percentile of device changes, and the distribution."""
    per_day = 24 * 60 // 5
    rows_per_window = GROW_STEPS * STEP_MINUTES // 5 + 1
    windows = []
    for source, share in free_shares(data).items():
        for first in range(0, len(share) - rows_per_window, per_day):
            devices = borrowed(share, first)
            changes = sum(a != b for a, b in itertools.pairwise(devices))
            windows.append((changes, source, first, devices))
    counts = np.array([w[0] for w in windows])
    picked = {}
    for name, q in (("churn_median", 0.5), ("churn_p90", 0.9)):
        target = float(np.quantile(counts, q, method="lower"))
        changes, source, first, devices = next(w for w in windows if w[0] == target)
        picked[name] = (source, first, devices)
    stats = {
        "windows": len(windows),
        "changes_median": float(np.median(counts)),
        "changes_p90": float(np.quantile(counts, 0.9)),
    }
    return picked, stats


def orz_lengths(data: Path, model: str, first: int, count: int) -> np.ndarray:
    """Mean response tokens of ORZ ``model`` at steps first .. first+count-1 (gaps interpolated)."""
    rows = read_csv(data / "rl_length" / "digitized_orz_response_length.csv")
    points = sorted(
        (float(r["training_step"]), float(r["mean_response_length_tokens"]))
        for r in rows
        if r["model"] == model
    )
    x, y = np.array(points).T
    steps = np.arange(first, first + count, dtype=float)
    if steps[-1] > x[-1] or steps[0] < x[0]:
        raise SystemExit(f"{model} covers steps {x[0]:.0f}..{x[-1]:.0f}, not {first}..{first + count - 1}")
    return np.interp(steps, x, y)


def length_shape(data: Path) -> tuple[float, float]:
    """p90/mean and p99/mean of MATH500 reference solutions (characters)."""
    chars = np.array([float(r["solution_chars"]) for r in read_csv(data / "lengths" / "math500_lengths.csv")])
    return float(np.quantile(chars, 0.9) / chars.mean()), float(np.quantile(chars, 0.99) / chars.mean())


def template_tokens(data: Path) -> float:
    """Prompt tokens beyond the question: verl's GSM8K prompt length minus the questions' chars / 4."""
    log = data / "rl_length" / "verl_gsm8k_ppo_Qwen2.5-0.5B-bsz256_2-prompt512-resp256-0.538.csv"
    prompt = np.mean([float(r["prompt_length/mean"]) for r in read_csv(log)])
    gsm8k = [
        float(r["question_chars"])
        for r in read_csv(data / "lengths" / "gsm8k_lengths.csv")
        if r["split"] == "train"
    ]
    return float(prompt - np.mean(gsm8k) / CHARS_PER_TOKEN)


def prompt_lengths(data: Path, count: int, seed: int) -> np.ndarray:
    problems = np.array(
        [float(r["problem_chars"]) for r in read_csv(data / "lengths" / "math500_lengths.csv")]
    )
    rng = np.random.default_rng(seed)
    draws = rng.choice(problems, size=(count, 128))
    return np.rint(draws.mean(axis=1) / CHARS_PER_TOKEN + template_tokens(data)).astype(int)


def length_columns(mean: np.ndarray, shape: tuple[float, float]) -> dict[str, list]:
    p90 = np.minimum(np.ceil(mean * shape[0]), MAX_RESPONSE)
    high = np.minimum(np.ceil(mean * shape[1]), MAX_RESPONSE)
    return {
        "response_mean": [round(float(v), 1) for v in mean],
        "response_p90": [int(v) for v in p90],
        "response_max": [int(v) for v in high],
    }


def write(path: Path, columns: dict[str, list]) -> int:
    names = list(columns)
    n = len(columns[names[0]])
    with path.open("w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(names)
        for i in range(n):
            out.writerow([columns[c][i] for c in names])
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="the shared data folder (cluster/, rl_length/, lengths/)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shape = length_shape(args.data)

    devices, minutes, leased = availability(args.data)
    capacity = [80.0] * GROW_STEPS
    for first, end, gb in PRESSURE:
        capacity[first:end] = [gb] * (end - first)
    grow = {
        "step": list(range(GROW_STEPS)),
        "devices": devices,
        "capacity_gb": capacity,
        "batch": [BATCH] * GROW_STEPS,
        "prompt_len": prompt_lengths(args.data, GROW_STEPS, seed=0).tolist(),
        **length_columns(orz_lengths(args.data, "ORZ-32B", 5, GROW_STEPS), shape),
        "src_minute": minutes,
        "src_idle_gpus": leased,
        "src_orz_step": list(range(5, 5 + GROW_STEPS)),
    }
    fixed_first, fixed_count = 22, 708  # ORZ-7B is drawn from step 22 to 729
    fixed = {
        "step": list(range(fixed_count)),
        "capacity_gb": [80.0] * fixed_count,
        "batch": [BATCH] * fixed_count,
        "prompt_len": prompt_lengths(args.data, fixed_count, seed=1).tolist(),
        **length_columns(orz_lengths(args.data, "ORZ-7B", fixed_first, fixed_count), shape),
        "src_orz_step": list(range(fixed_first, fixed_first + fixed_count)),
    }
    changes = [(k, devices[k]) for k in range(GROW_STEPS) if k == 0 or devices[k] != devices[k - 1]]
    windows, churn = churn_windows(args.data)
    for name, (source, first, borrowed_devices) in windows.items():
        columns = {
            **{c: grow[c] for c in ("step", "capacity_gb")},
            "devices": borrowed_devices,
            **{c: grow[c] for c in ("batch", "prompt_len", "response_mean", "response_p90", "response_max")},
            "src_cluster": [source] * GROW_STEPS,
            "src_row": [first + k * STEP_MINUTES // 5 for k in range(GROW_STEPS)],
        }
        columns["capacity_gb"] = [80.0] * GROW_STEPS
        shrinks = sum(b < a for a, b in itertools.pairwise(borrowed_devices))
        moved = sum(b != a for a, b in itertools.pairwise(borrowed_devices))
        churn[name] = {
            "rows": write(args.out / f"{name}.csv", columns),
            "source": source,
            "first_row": first,
            "changes": moved,
            "shrinks": shrinks,
        }
    print(
        json.dumps(
            {
                "benchmark": "build_traces",
                "grow_1024.csv": write(args.out / "grow_1024.csv", grow),
                "orz7b_fixed.csv": write(args.out / "orz7b_fixed.csv", fixed),
                "device_changes": changes,
                "churn": churn,
                "length_shape_p90_p99_over_mean": [round(v, 3) for v in shape],
                "template_tokens": round(template_tokens(args.data), 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
