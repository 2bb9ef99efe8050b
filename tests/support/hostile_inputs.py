"""Broken and hostile inputs on the real-model path, each beside a base that works: a tiny Llama
directory with its tokenizer, a JSONL data set and the gsm8k reward. ``cases`` writes them and gives
each case's ``nereus run`` arguments and a piece of the one line it must be refused with (the CLI
tests and ``benchmarks.bench_bad_input`` share them)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import yaml

from tests.support.hf_models import write_model, write_tokenizer

ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
    "reward_model": {"style": "rule", "ground_truth": "4"},
    "extra_info": {"index": 0},
}
REWARDS = {
    "raises": "def score(a, b, c, d):\n    raise KeyError('no answer field')\n",
    "hangs": "import time\ndef score(a, b, c, d):\n    time.sleep(3600)\n",
    "nan": "def score(a, b, c, d):\n    return float('nan')\n",
    "inf": "def score(a, b, c, d):\n    return float('inf')\n",
    "string": "def score(a, b, c, d):\n    return 'correct'\n",
    "dict-no-score": "def score(a, b, c, d):\n    return {'acc': 1.0}\n",
    "prints-mb": "import sys\ndef score(a, b, c, d):\n    print('x' * 50_000_000)\n"
    "    sys.stderr.write('y' * 10_000_000)\n    return 'nope'\n",
    "sys-exit": "import sys\ndef score(a, b, c, d):\n    sys.exit(3)\n",
    "os-exit": "import os\ndef score(a, b, c, d):\n    os._exit(0)\n",
}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def base(root: Path) -> Path:
    """The model directory, data and config that work; returns the config's path."""
    model = root / "llama"
    if not model.exists():
        write_model("llama", model, vocab_size=320)
        write_tokenizer(model)
    data = write_jsonl(root / "train.jsonl", [dict(ROW, extra_info={"index": i}) for i in range(4)])
    config = {
        "name": "hostile",
        "cluster": {"devices": 2},
        "model": {"path": str(model)},
        "data": {"train_files": [str(data)], "max_prompt_length": 64, "max_response_length": 16},
        "reward": {"function": "gsm8k"},
        "job": {"steps": 1, "batch_size": 2},
    }
    path = root / "base.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _copy(root: Path, name: str) -> Path:
    target = root / name
    shutil.copytree(root / "llama", target, symlinks=True)
    return target


def _edit_json(path: Path, **changes: Any) -> None:
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def _rewrite_tensors(path: Path, change: Any) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def model_cases(root: Path) -> dict[str, tuple[Path, str]]:
    """Case -> (a broken copy of the model directory, a piece of its refusal)."""
    import torch

    out: dict[str, tuple[Path, str]] = {}

    def case(name: str, needle: str) -> Path:
        path = _copy(root, f"model-{name}")
        out[name] = (path, needle)
        return path

    _edit_json(
        case("layers-1e9", "num_hidden_layers: must be less than or equal to 4096") / "config.json",
        num_hidden_layers=10**9,
    )
    _edit_json(case("vocab-1e7", "the initial plan") / "config.json", vocab_size=10_000_000)
    _edit_json(case("model-type", "model_type 'gpt2' does not match") / "config.json", model_type="gpt2")
    _edit_json(
        case("architecture", "MistralForCausalLM is not supported; supported: LlamaForCausalLM")
        / "config.json",
        architectures=["MistralForCausalLM"],
    )
    file = case("truncated", "is truncated") / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    file = case("header-damaged", "the header is not JSON") / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:24] = b"\xff" * 16
    file.write_bytes(bytes(data))
    file = case("header-oversized", "over safetensors' 100,000,000") / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 1 << 40) + file.read_bytes()[8:])
    _rewrite_tensors(
        case("missing-tensor", "lacks tensor 'model.norm.weight'"), lambda t: t.pop("model.norm.weight")
    )
    _rewrite_tensors(
        case("wrong-shape", "tensor 'model.norm.weight' has shape [16]"),
        lambda t: t.update({"model.norm.weight": torch.ones(16)}),
    )
    _rewrite_tensors(
        case("wrong-dtype", "tensor 'model.norm.weight' is I32"),
        lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)}),
    )
    outside = root / "outside"
    outside.mkdir(exist_ok=True)
    shutil.copy(root / "llama" / "model.safetensors", outside / "model.safetensors")
    path = case("symlink-outside", "leads outside")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to(outside / "model.safetensors")
    path = case("index-outside", "leads outside")
    (path / "model.safetensors").unlink()
    names = json.loads(
        (root / "llama" / "model.safetensors").read_bytes()[8:][
            : struct.unpack("<Q", (root / "llama" / "model.safetensors").read_bytes()[:8])[0]
        ]
    )
    weight_map = {n: "../outside/model.safetensors" for n in names if n != "__metadata__"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # The tokenizer's chat template and EOS.
    templates = {
        "template-raises": (
            "{{ raise_exception('no system role') }}",
            "raised TemplateError: no system role",
        ),
        "template-loops": (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
            "ran past",
        ),
        "template-empty": ("{% if false %}x{% endif %}", "renders an empty prompt"),
    }
    for name, (template, needle) in templates.items():
        (case(name, needle) / "chat_template.jinja").write_text(template)
    path = case("no-eos", "no EOS token")
    _edit_json(path / "tokenizer_config.json", eos_token=None)
    (path / "generation_config.json").unlink()
    return out


def data_cases(root: Path) -> dict[str, tuple[Path, str]]:
    """Case -> (a broken training file, a piece of its refusal)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = [dict(ROW, extra_info={"index": i}) for i in range(4)]
    out = {
        "missing-column": (
            write_jsonl(root / "missing.jsonl", [{k: v for k, v in ROW.items() if k != "reward_model"}]),
            "missing column reward_model",
        ),
        "mistyped-column": (
            write_jsonl(root / "mistyped.jsonl", [dict(ROW, data_source=5)]),
            "row 0: data_source",
        ),
        "prompt-not-messages": (
            write_jsonl(root / "text-prompt.jsonl", [dict(ROW, prompt="What is 2 + 2?")]),
            "row 0: prompt must be a non-empty list",
        ),
        "prompt-10mb": (
            write_jsonl(
                root / "huge-prompt.jsonl",
                [dict(ROW, prompt=[{"role": "user", "content": "word " * 2_000_000}])],
            ),
            "all 1 prompts are longer than data.max_prompt_length",
        ),
    }
    empty = root / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(good).slice(0, 0), empty)
    out["empty-split"] = (empty, "the files hold no rows")
    n = 1_000_000
    big = pa.table(
        {
            "data_source": pa.array(["s"] * n),
            "prompt": pa.array([ROW["prompt"]] * n),
            "reward_model": pa.array([ROW["reward_model"]] * n),
        }
    )
    pq.write_table(big, root / "million.parquet")
    out["million-rows"] = (root / "million.parquet", "over data.max_rows=500,000")
    (root / "fake.parquet").write_text("data_source,prompt\nx,y\n")
    out["not-parquet"] = (root / "fake.parquet", "not readable as Parquet")
    return out


def cases(root: Path) -> dict[str, tuple[list[str], str]]:
    """Every case: its ``nereus run`` argv (after ``run``) and a piece of its one-line refusal."""
    config = str(base(root))
    out: dict[str, tuple[list[str], str]] = {}
    for name, (path, needle) in model_cases(root).items():
        out[f"model-{name}"] = ([config, "--set", f"model.path={path}"], needle)
    for name, (path, needle) in data_cases(root).items():
        out[f"data-{name}"] = ([config, "--set", f"data.train_files=[{path}]"], needle)
    for name, code in REWARDS.items():
        (root / f"reward_{name}.py").write_text(code)
        sets = ["--set", f"reward.function={root / f'reward_{name}.py'}:score", "--set", "reward.timeout_s=2"]
        out[f"reward-{name}"] = ([config, *sets], "reward function ")
    return out


__all__ = ["REWARDS", "ROW", "base", "cases", "data_cases", "model_cases", "write_jsonl"]
