"""The job of the TRL side-by-side benchmark (benchmarks/bench_trl.py), one definition for both
systems: a random Qwen2ForCausalLM written with ``save_pretrained``, a byte-level BPE tokenizer
trained on the project's GSM8K text with a chat template, GSM8K in verl's format made by the
project's converter (``nereus data gsm8k``), the digit-share reward (examples/rewards/digit_share.py),
and the matched GRPO settings as TRL's ``GRPOConfig`` (``trl_args``) and as a Nereus config
(``nereus_config``). Nothing is downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nereus_core.hf.tokenizer import chat_prompt_ids

ROOT = Path(__file__).resolve().parents[1]
REWARD = "examples/rewards/digit_share.py:digit_share"  # relative to ROOT, where Nereus runs
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
    cmd = [sys.executable, "-m", "flows.cli.main", "data", "gsm8k", "--out", str(out)]
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
        max_grad_norm=0.0,  # no clipping on either side (Nereus: ppo.grad_clip 0)
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
            "grad_clip": 0.0,
            "temperature": 1.0,
        },
        "plan": {"actor/generate": layout, "actor/train": layout},
    }
