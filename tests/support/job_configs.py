"""Job config sections the job tests share: the demo's model (examples/tiny_ppo.yaml), a smaller model
for jobs that only need to run, and the fault tests' job with its forced live switch.

Each is a template: a test copies it (``dict(...)``, ``copy.deepcopy``) before changing anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Hugging Face LlamaConfig names, as the ``model:`` section takes them.
DEMO_MODEL = {
    "vocab_size": 32,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
SMALL_MODEL = {
    "vocab_size": 32,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

# The demo's model and first plan; 8 MiB per slot fits it at 6-token responses, not at 24 (the cost
# model's memory estimate), so the response-length event before step 1 forces a live switch.
FAULT_JOB: dict[str, Any] = {
    "name": "fault-test",
    "cluster": {"devices": 4, "memory_per_device": "8MiB"},
    "model": dict(DEMO_MODEL),
    "job": {
        "steps": 3,
        "batch_size": 16,
        "prompt_len": 4,
        "response_len": 6,
        "scenario": [{"step": 1, "response_len": 24}],
        "switch_recovery": "sync",  # the fault tests check the checkpoint each switch writes first
    },
    "ppo": {"reward_fit_steps": 4, "reward_fit_batch": 8, "ppo_epochs": 1, "mini_batches": 2},
    "plan": {
        "actor/generate": {"pp": 2, "devices": [0, 1]},
        "actor/train": {"pp": 2, "devices": [0, 1]},
        "critic/train": {"pp": 2, "devices": [0, 1]},
        "critic/infer": {"pp": 2, "devices": [0, 1]},
        "reference/infer": {"devices": [0]},
        "reward/infer": {"pp": 2, "devices": [0, 1]},
    },
}


MAX_PROMPT = 256  # the trained test tokenizer's GSM8K prompts: 108 to 503 tokens, median 214


def qwen2_gsm8k_config(files: dict[str, Path], **job: Any) -> dict[str, Any]:
    """A PPO job on a tiny Qwen2 directory and the GSM8K files (``files``: model, train, test)."""
    return {
        "name": "qwen2-gsm8k",
        "cluster": {"devices": 2},
        "model": {"path": str(files["model"])},
        "data": {
            "train_files": [str(files["train"])],
            "val_files": [str(files["test"])],
            "max_prompt_length": MAX_PROMPT,
            "max_response_length": 16,
            "seed": 3,
        },
        "validation": {"every": 2, "batch_size": 64},
        "reward": {"function": "gsm8k"},
        "job": {"steps": 2, "batch_size": 8, "snapshot_every": 1, "keep_checkpoints": 0, **job},
        "ppo": {"ppo_epochs": 1, "mini_batches": 2, "kl_coef": 0.001},
        "plan": {
            "actor/generate": {"tp": 2, "devices": [0, 1]},
            "actor/train": {"dp": 2, "devices": [0, 1]},
            "critic/train": {"tp": 2, "devices": [0, 1]},
            "critic/infer": {"dp": 2, "devices": [0, 1]},
            "reference/infer": {"devices": [1]},
        },
    }
