"""Empty data files and a stand-in tokenizer directory: what the config's checks read (names, not
contents)."""

from __future__ import annotations

import tempfile
from pathlib import Path


def files(tmp_path: Path) -> tuple[str, str]:
    train, val = tmp_path / "train.parquet", tmp_path / "val.jsonl"
    train.write_bytes(b"")
    val.write_text("")
    return str(train), str(val)


def tokenizer_dir() -> str:
    """A directory with what a tokenizer with a chat template leaves (the config reads file names)."""
    root = Path(tempfile.mkdtemp(prefix="tok-"))
    (root / "tokenizer.json").write_text("{}")
    (root / "chat_template.jinja").write_text("{{ messages }}")
    return str(root)


TOKENIZER = tokenizer_dir()
