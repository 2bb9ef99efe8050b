"""GRPO side by side with TRL's GRPOTrainer: one job, two systems, one run.

The job (benchmarks/grpo_peer_job.py) is written here, nothing downloaded: a random
Qwen2ForCausalLM, a BPE tokenizer with a chat template, GSM8K prompts in verl's format and the
digit-share reward (examples/rewards/digit_share.py), which Nereus calls as ``reward.function`` and TRL
through a thin wrapper. The same settings go to both: group size (TRL ``num_generations``), prompts
per step, the response limit (EOS stops a response earlier), sampling at temperature 1 without
top-k/top-p, the clipped loss with token-mean aggregation (TRL ``loss_type="dapo"``),
``epsilon``/``clip_ratio``, no KL term (``beta=0``), group-scaled rewards, one optimizer step per
generated batch (TRL ``steps_per_generation=num_iterations=1``; Nereus ``ppo_epochs=mini_batches=1``),
AdamW at a constant learning rate without gradient clipping or weight decay, prompts in file order.
TRL runs in this process on CPU with one thread (no vLLM); Nereus runs ``python -m flows.cli.main run``
on 1 and on 2 device slots (one worker process and thread each), fixed plan (``job.adapt: false``).

Each round runs every system once, back to back; the order is reversed every other round, so a load
that drifts weighs on each alike. Printed JSON: per round and system, ``step_s`` and its median (the
wall time of a training step; TRL: between its step-end callbacks; Nereus: the history's
``wall_s``), ``tokens_per_s`` (generated tokens, stop tokens included, over the summed step times),
the reward curve (mean reward per step), the 1-minute load average before and after, and the median
seconds per stage per step (Nereus: metrics/steps.parquet; TRL: its generation and reward calls,
timed here, and the rest of its step). ``summary``: every round's steps pooled, and each Nereus
run's median step over TRL's (pooled and per round).

    python -m benchmarks.bench_trl [--steps 16] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.grpo_peer_job import (
    Settings,
    nereus_config,
    prompt_lengths,
    trl_args,
    write_data,
    write_model,
    write_tokenizer,
)
from examples.rewards.digit_share import trl_digit_share

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class TrlClock:
    """What TRL's run reports, per step: walls (between its step-end callbacks), generated tokens,
    mean rewards, and the seconds of its generation and reward calls (timed here)."""

    walls: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)
    reward_s: list[float] = field(default_factory=list)

    def callback(self) -> Any:
        """A TrainerCallback recording step walls and the logged reward."""
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                self.last = time.perf_counter()

            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                now = time.perf_counter()
                clock.walls.append(now - self.last)
                self.last = now

            def on_log(
                self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any
            ) -> None:
                if logs and "reward" in logs:
                    clock.rewards.append(float(logs["reward"]))

        return Clock()

    def reward(self, completions: list[Any], completion_ids: list[list[int]], **columns: Any) -> list[float]:
        """The digit-share reward, timed, counting the generated tokens (up to and including EOS)."""
        start = time.perf_counter()
        self.tokens.append(sum(len(ids) for ids in completion_ids))
        out = trl_digit_share(completions, **columns)
        self.reward_s.append(time.perf_counter() - start)
        return out

    def timed(self, generate: Any) -> Any:
        """TRL's generation of a step (tokenize, sample, decode), timed."""

        def timed_generate(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            out = generate(*a, **k)
            self.generate_s.append(time.perf_counter() - start)
            return out

        return timed_generate


def run_trl(model_dir: Path, train: Path, s: Settings, work: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the job; per-step walls, generated tokens, rewards and generation seconds."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    clock = TrlClock()

    def digit_share(completions: list[Any], completion_ids: list[list[int]], **columns: Any) -> list[float]:
        return clock.reward(completions, completion_ids, **columns)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digit_share,
        args=trl_args(s, work / "trl"),
        train_dataset=Dataset.from_parquet(str(train)),
        processing_class=tokenizer,
        callbacks=[clock.callback()],
    )
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would mix into the printed JSON
    trainer._generate = clock.timed(trainer._generate)
    trainer.train()
    rest = [w - g - r for w, g, r in zip(clock.walls, clock.generate_s, clock.reward_s, strict=True)]
    return {
        **figures(clock.walls, clock.tokens, clock.rewards),
        # TRL times no stages: its generation and reward calls are timed here; the rest of a step is
        # its log-prob pass, loss, backward and optimizer step (and its logging).
        "stages_s_median": {
            "generate": round(statistics.median(clock.generate_s), 4),
            "reward": round(statistics.median(clock.reward_s), 4),
            "rest_of_step": round(statistics.median(rest), 4),
        },
    }


def run_nereus(model_dir: Path, data: Path, s: Settings, slots: int, work: Path) -> dict[str, Any]:
    """``python -m flows.cli.main run`` on ``slots`` slots; figures from the run's metrics tables."""
    import pyarrow.parquet as pq
    import yaml

    config, out = work / f"nereus-{slots}.yaml", work / f"nereus-{slots}"
    config.write_text(yaml.safe_dump(nereus_config(model_dir, data, s, slots)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "flows.cli.main", "run", str(config), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"nereus run on {slots} slots failed: " + " | ".join(tail))
    history = sorted(pq.read_table(out / "metrics" / "history.parquet").to_pylist(), key=lambda h: h["step"])
    rows = pq.read_table(out / "metrics" / "steps.parquet").to_pylist()
    per_step: dict[str, dict[int, float]] = {}
    for r in rows:
        key = f"{r['model']}/{r['stage']}"
        per_step.setdefault(key, {}).setdefault(r["step"], 0.0)
        per_step[key][r["step"]] += float(r["duration_s"])
    stages = {k: round(statistics.median(v.values()), 4) for k, v in sorted(per_step.items())}
    walls = [float(h["wall_s"]) for h in history]
    overhead = round(statistics.median(float(h["overhead_s"]) for h in history), 4)
    return {
        **figures(walls, [int(h["tokens"]) for h in history], [float(h["score"]) for h in history]),
        "stages_s_median": {**stages, "outside_stages": overhead},
    }


def figures(walls: list[float], tokens: list[int], rewards: list[float]) -> dict[str, Any]:
    """Median step, generated tokens per second over all steps, and the reward curve."""
    return {
        "steps": len(walls),
        "step_s_median": round(statistics.median(walls), 4),
        "step_s": [round(w, 4) for w in walls],
        "generated_tokens": sum(tokens),
        "tokens_per_s": round(sum(tokens) / sum(walls), 2),
        "reward": [round(r, 4) for r in rewards],
    }


def run_round(order: list[str], model_dir: Path, train: Path, s: Settings, work: Path) -> dict[str, Any]:
    """Each system of ``order`` once, back to back, with the 1-minute load average around each run."""
    out: dict[str, Any] = {"order": order}
    for name in order:
        load = os.getloadavg()[0]
        if name == "trl":
            out[name] = run_trl(model_dir, train, s, work)
        else:
            try:
                out[name] = run_nereus(model_dir, train, s, int(name.split("_")[1][0]), work)
            except RuntimeError as err:  # recorded as failed, left out of the summary; the round goes on
                out[name] = {"status": f"failed: {err}"}
        out[name]["load_1min"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    return out


def pooled(rounds: list[dict[str, Any]], name: str, base: str = "trl") -> dict[str, Any]:
    """``name``'s steps of every round it completed (and ``base`` too) together, and its median step
    over ``base``'s in those rounds."""
    done = [r for r in rounds if "step_s" in r[name] and "step_s" in r[base]]
    if not done:
        return {"status": "no completed run"}
    runs, bases = [r[name] for r in done], [r[base] for r in done]
    walls = [w for run in runs for w in run["step_s"]]
    out = {
        "step_s_median": round(statistics.median(walls), 4),
        "tokens_per_s": round(sum(run["generated_tokens"] for run in runs) / sum(walls), 2),
    }
    if name != base:
        base_median = statistics.median(w for run in bases for w in run["step_s"])
        out["step_ratio_vs_trl"] = round(out["step_s_median"] / base_median, 2)
        out["step_ratio_vs_trl_per_round"] = [
            round(run["step_s_median"] / b["step_s_median"], 2) for run, b in zip(runs, bases, strict=True)
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--rounds", type=int, default=2, help="each system once per round; order reversed")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    s = Settings(steps=args.steps)
    torch.set_num_threads(1)  # TRL's process as one Nereus worker: one thread
    systems = ["trl", "nereus_1slot", "nereus_2slot"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        tokenizer = write_tokenizer(model_dir)
        params = write_model(model_dir, tokenizer.eos_token_id)
        train = write_data(work / "gsm8k")
        lengths = prompt_lengths(tokenizer, train)
        if max(lengths) > s.max_prompt_len:  # both must see every prompt: neither filters
            raise SystemExit(f"a prompt has {max(lengths)} tokens > max_prompt_len={s.max_prompt_len}")
        rounds = []
        for k in range(args.rounds):  # ABC then CBA: a load that drifts weighs on each system alike
            (work / f"round{k}").mkdir()
            order = systems if k % 2 == 0 else systems[::-1]
            rounds.append(run_round(order, model_dir, train, s, work / f"round{k}"))
    result: dict[str, Any] = {
        "settings": {**asdict(s), "batch": s.batch, "rounds": args.rounds},
        "model": {"params": params, "tokenizer_tokens": len(tokenizer)},
        "prompt_tokens": {"mean": round(statistics.mean(lengths), 1), "max": max(lengths)},
        "summary": {name: pooled(rounds, name) for name in systems},
        "rounds": rounds,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
