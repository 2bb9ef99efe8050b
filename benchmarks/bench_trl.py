"""GRPO side by side with TRL's GRPOTrainer (issue 15): one job, two systems, one run.

Everything is written here, nothing downloaded: a random Qwen2ForCausalLM (``save_pretrained``), a
byte-level BPE tokenizer trained on the project's GSM8K text with a chat template, and the GSM8K
prompts in verl's format made by the project's converter (``nereus data gsm8k``). The reward is
benchmarks/digit_reward.py (the share of digit characters in a response), which Nereus calls as
``reward.function`` and TRL through a thin wrapper.

The same settings go to both: group size (TRL ``num_generations``), prompts per step, the response
limit (EOS stops a response earlier), sampling at temperature 1 without top-k/top-p, the clipped
loss with token-mean aggregation (TRL ``loss_type="dapo"``), ``epsilon``/``clip_ratio``, no KL term
(``beta=0``), group-scaled rewards, one optimizer step per generated batch (TRL
``steps_per_generation=num_iterations=1``; Nereus ``ppo_epochs=mini_batches=1``), AdamW at a
constant learning rate without gradient clipping or weight decay, prompts in file order. TRL
runs in this process on CPU (no vLLM); Nereus runs ``python -m flows.cli run`` on 1 and on 2 device
slots (worker processes), fixed plan (``job.adapt: false``).

Printed JSON, per system: ``step_s_median`` (the wall time of a training step; TRL: between its
step-end callbacks; Nereus: the history's ``wall_s``), ``tokens_per_s`` (generated tokens, stop
tokens included, over the summed step times), the reward curve (mean reward per step), and the
ratio of each Nereus run's median step to TRL's. For Nereus also the median seconds per stage per
step (metrics/steps.parquet) and TRL's generation seconds, to say where the time goes.

    python benchmarks/bench_trl.py [--steps 10] [--out FILE]
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the project's packages and the reward

from benchmarks.digit_reward import trl_digit_share  # noqa: E402
from nereus_core.tokenizer import chat_prompt_ids  # noqa: E402

REWARD = "benchmarks/digit_reward.py:digit_share"  # relative to ROOT, where Nereus runs
TEXT = ROOT / "data" / "text" / "gsm8k_test_first500.jsonl"
SIZES = {  # ~1.7M parameters; 4 heads and 2 kv heads divide by tp=2
    "vocab_size": 512,
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass(frozen=True)
class Settings:
    """What both systems run with."""

    steps: int = 16
    group: int = 4  # responses per prompt
    prompts: int = 4  # prompts per step
    response_len: int = 32  # max new tokens
    max_prompt_len: int = 448  # every GSM8K prompt of the split fits (checked)
    lr: float = 3e-3
    clip: float = 0.2
    seed: int = 0

    @property
    def batch(self) -> int:
        return self.group * self.prompts


def write_tokenizer(path: Path) -> Any:
    """A byte-level BPE tokenizer trained on the GSM8K questions and answers, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = []
    for line in TEXT.read_text().splitlines():
        row = json.loads(line)
        lines += [row["question"], row["answer"]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SIZES["vocab_size"],
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(lines, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return tokenizer


def write_model(path: Path, eos_id: int) -> int:
    """A random Qwen2ForCausalLM (tied embeddings, q/k/v biases) saved to ``path``; its parameters."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        **SIZES,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
    )
    model = Qwen2ForCausalLM._from_config(config, attn_implementation="eager")
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def write_data(out: Path) -> Path:
    """GSM8K in verl's format by the project's converter; the train split's path."""
    cmd = [sys.executable, "-m", "flows.cli", "data", "gsm8k", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return out / "train.parquet"


def prompt_lengths(tokenizer: Any, train: Path) -> list[int]:
    """Each train prompt's token count as rendered by the chat template (both systems render so)."""
    import pyarrow.parquet as pq

    chats = pq.read_table(train, columns=["prompt"]).column("prompt").to_pylist()
    return [len(ids) for ids in chat_prompt_ids(tokenizer, chats)]


def trl_args(s: Settings, out_dir: Path) -> Any:
    """TRL's GRPOConfig for the job (the same settings as ``nereus_config``'s)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        max_steps=s.steps,
        per_device_train_batch_size=s.batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=s.group,
        max_completion_length=s.response_len,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type="dapo",  # token-mean over the batch
        beta=0.0,
        epsilon=s.clip,
        scale_rewards="group",
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,  # Nereus does not clip gradients
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        shuffle_dataset=False,
        seed=s.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )


def run_trl(model_dir: Path, train: Path, s: Settings, work: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the job; per-step walls, generated tokens, rewards and generation seconds."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    walls: list[float] = []
    tokens: list[int] = []
    rewards: list[float] = []
    generate_s: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            walls.append(now - self.last)
            self.last = now

        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any
        ) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    def reward(completions: list[Any], completion_ids: list[list[int]], **columns: Any) -> list[float]:
        tokens.append(sum(len(ids) for ids in completion_ids))  # up to and including EOS
        return trl_digit_share(completions, **columns)

    reward.__name__ = "digit_share"
    args = trl_args(s, work / "trl")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_parquet(str(train)),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    inner = trainer._generate  # timed: TRL's generation of a step (tokenize, sample, decode)

    def timed_generate(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        out = inner(*a, **k)
        generate_s.append(time.perf_counter() - start)
        return out

    trainer._generate = timed_generate
    trainer.train()
    return {
        **figures(walls, tokens, rewards),
        "stages_s_median": {"generate": round(statistics.median(generate_s), 4)},
    }


def nereus_config(model_dir: Path, data: Path, s: Settings, slots: int) -> dict[str, Any]:
    """The job for ``slots`` device slots: both GRPO stages data-parallel over all of them."""
    layout = {"tp": 1, "pp": 1, "dp": slots, "devices": list(range(slots))}
    return {
        "name": f"bench-trl-{slots}slot",
        "cluster": {"devices": slots, "memory_per_device": "4GiB"},
        "model": {"path": str(model_dir)},
        "job": {
            "steps": s.steps,
            "seed": s.seed,
            "batch_size": s.batch,
            "prompt_len": s.max_prompt_len,  # the data section's lengths, stated again
            "response_len": s.response_len,
            "adapt": False,
        },
        "data": {
            "train_files": [str(data)],
            "max_prompt_length": s.max_prompt_len,
            "max_response_length": s.response_len,
            "shuffle": False,
            "seed": s.seed,
        },
        "reward": {"function": REWARD},
        "algorithm": {
            "name": "grpo",
            "group_size": s.group,
            "baseline": "group_mean",
            "scale_rewards": "group",
            "loss_agg_mode": "token-mean",
        },
        "ppo": {
            "kl_coef": 0.0,
            "use_kl_loss": False,
            "clip_ratio": s.clip,
            "ppo_epochs": 1,
            "mini_batches": 1,
            "actor_lr": s.lr,
            "temperature": 1.0,
        },
        "plan": {"actor/generate": layout, "actor/train": layout},
    }


def nereus_missing() -> str | None:
    """Why Nereus cannot run this job (its GRPO step does not take a prompt source yet), or None."""
    import inspect

    from flows import grpo_step

    if "prompt_source" not in inspect.signature(grpo_step.run_step).parameters:
        return "the GRPO step does not take the data set's prompt source yet (it runs the count task)"
    return None


def run_nereus(model_dir: Path, data: Path, s: Settings, slots: int, work: Path) -> dict[str, Any]:
    """``python -m flows.cli run`` on ``slots`` slots; figures from the run's metrics tables."""
    import pyarrow.parquet as pq
    import yaml

    config, out = work / f"nereus-{slots}.yaml", work / f"nereus-{slots}"
    config.write_text(yaml.safe_dump(nereus_config(model_dir, data, s, slots)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config), "--out", str(out)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    s = Settings(steps=parser.parse_args().steps)
    out_file = parser.parse_args().out
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        tokenizer = write_tokenizer(model_dir)
        params = write_model(model_dir, tokenizer.eos_token_id)
        train = write_data(work / "gsm8k")
        lengths = prompt_lengths(tokenizer, train)
        if max(lengths) > s.max_prompt_len:  # both must see every prompt: neither filters
            raise SystemExit(f"a prompt has {max(lengths)} tokens > max_prompt_len={s.max_prompt_len}")
        result: dict[str, Any] = {
            "settings": {**asdict(s), "batch": s.batch},
            "model": {"params": params, "tokenizer_tokens": len(tokenizer)},
            "prompt_tokens": {"mean": round(statistics.mean(lengths), 1), "max": max(lengths)},
            "load_average_before": list(os.getloadavg()),
        }
        result["trl"] = run_trl(model_dir, train, s, work)
        missing = nereus_missing()
        for slots in (1, 2):
            key = f"nereus_{slots}slot"
            if missing:
                result[key] = {"status": f"not run: {missing}"}
                continue
            result[key] = run_nereus(model_dir, train, s, slots, work)
            result[key]["vs_trl_step_ratio"] = round(
                result[key]["step_s_median"] / result["trl"]["step_s_median"], 2
            )
        result["load_average_after"] = list(os.getloadavg())
    text = json.dumps(result, indent=1)
    print(text)
    if out_file:
        out_file.write_text(text + "\n")


if __name__ == "__main__":
    main()
