"""Importing a ~100M-parameter Hugging Face model onto 2 devices: each device reads only its own shard.

The benchmark writes a random Llama model (``save_pretrained``, several safetensors files) and,
side by side on one 2-device CPU pool, per layout (tp2: every tensor split in two; pp2: each
device holds half the layers; embedding on the first, lm_head on the last):

- ``import``: ``tasks.model_ops.import_model``: every device reads its own slices from the files,
  memory-mapped (``engine.hf_load``); per device, the bytes its store copied out of the files
  (``file_bytes``, counted by the store as it reads) against the files' total, and its seconds;
- ``driver``: the path without import: the driver loads every file whole and sends the full state
  to each device, which keeps its slices (``model_ops.load_model(full_state=...)``); the bytes each
  device receives are the whole model's.

Each import is checked bit for bit against the files (the full state assembled from the devices).
Figures are medians over ``--repeats`` loads of each path (all listed). The files are in the page
cache after being written (the usual case for a model loaded twice, e.g. actor and reference), so
the seconds measure copying out of memory, not disk reads; the byte counts do not depend on it.

    python -m benchmarks.bench_import [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nereus_core.engine.hf_load import HFSource
from nereus_core.layout import Layout
from nereus_core.model.hf_dir import read_hf_config
from tasks import model_ops
from tasks.runtime.device_pool import DevicePool

# ~100M parameters: 8 Llama layers of width 768 with a 32k vocabulary (embedding and lm_head untied).
SIZES = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
}
LAYOUTS = {
    "tp2": Layout.contiguous(tp=2),
    "pp2": Layout.contiguous(pp=2, micro_batches=2),
}
NAME = "reference/infer"


def write_model(path: Path) -> int:
    """A random ~100M-parameter LlamaForCausalLM saved to ``path`` in 100 MB files; returns its parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=False))
    model.save_pretrained(path, max_shard_size="100MB")
    return sum(p.numel() for p in model.parameters())


def _import(pool: DevicePool, layout: Layout, path: Path) -> dict[str, Any]:
    config = read_hf_config(path)
    start = time.perf_counter()
    figures = model_ops.import_model(pool, layout, name=NAME, config=config, source=HFSource(str(path)))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "devices": figures}


def _driver(pool: DevicePool, layout: Layout, path: Path) -> float:
    config = read_hf_config(path)
    start = time.perf_counter()
    full: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        full.update(load_file(file))
    model_ops.load_model(pool, layout, name=NAME, config=config, full_state=full)
    return time.perf_counter() - start


def _verified(pool: DevicePool, layout: Layout, path: Path) -> bool:
    """The imported state, assembled from the devices, equals the files' tensors bitwise."""
    full = model_ops.full_state(pool, layout, name=NAME, config=read_hf_config(path))
    files: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        files.update(load_file(file))
    return sorted(full) == sorted(files) and all(torch.equal(full[k], files[k]) for k in files)


def run(repeats: int, root: Path) -> dict[str, Any]:
    path = root / "llama-100m"
    params = write_model(path)
    file_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    out: dict[str, Any] = {
        "model": {
            **SIZES,
            "parameters": params,
            "files": len(list(path.glob("*.safetensors"))),
            "file_bytes": file_bytes,
        },
        "scenarios": {},
    }
    with DevicePool(2) as pool:
        for key, layout in LAYOUTS.items():
            pool.build_groups(layout)
            imports, driver = [], []
            verified = True
            for _ in range(repeats):
                imports.append(_import(pool, layout, path))
                verified = verified and _verified(pool, layout, path)
                model_ops.unload_model(pool, layout, name=NAME)
                driver.append(_driver(pool, layout, path))
                model_ops.unload_model(pool, layout, name=NAME)
            per_device = []
            for rank in range(layout.world_size):
                got = [run["devices"][rank] for run in imports]
                read = statistics.median(g["file_bytes"] for g in got)
                per_device.append(
                    {
                        "device": layout.devices[rank],
                        "file_bytes": int(read),
                        "fraction_of_files": round(read / file_bytes, 4),
                        "read_s": round(statistics.median(g["read_s"] for g in got), 3),
                        "install_s": round(statistics.median(g["install_s"] for g in got), 3),
                    }
                )
            walls = [r["wall_s"] for r in imports]
            out["scenarios"][key] = {
                "import": {
                    "median_s": round(statistics.median(walls), 3),
                    "all_s": [round(w, 3) for w in walls],
                    "per_device": per_device,
                    "verified_bitwise": verified,
                },
                "driver": {
                    "median_s": round(statistics.median(driver), 3),
                    "all_s": [round(w, 3) for w in driver],
                    "bytes_to_each_device": file_bytes,
                },
                "speedup": round(statistics.median(driver) / statistics.median(walls), 2),
            }
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nereus-bench-import-") as root:
        result = run(args.repeats, Path(root))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
