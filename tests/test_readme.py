"""The README's config block for the demo is examples/tiny_ppo.yaml, compared as YAML data.

The block is the first fenced ``yaml`` block after the "Config format" heading. Comments and
layout may differ; every key and value must not. A drift fails with one line per difference,
naming the dotted path and both values.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEMO = ROOT / "examples" / "tiny_ppo.yaml"
HEADING = re.compile(r"^#+\s+Config format\s*$", re.MULTILINE)
YAML_BLOCK = re.compile(r"^```ya?ml[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def config_block(markdown: str) -> str:
    """The text of the first ```yaml block after the "Config format" heading."""
    heading = HEADING.search(markdown)
    if heading is None:
        raise ValueError('README.md has no "Config format" heading; the demo config block goes under it')
    block = YAML_BLOCK.search(markdown, heading.end())
    if block is None:
        raise ValueError('README.md has no ```yaml block after "Config format"; add the demo config there')
    return block.group(1)


def differences(readme: Any, demo: Any, path: str = "") -> list[str]:
    """One line per place where the two parsed documents differ, by dotted path."""
    where = path or "<top>"
    if isinstance(readme, dict) and isinstance(demo, dict):
        lines = []
        for key in [*demo, *(k for k in readme if k not in demo)]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in readme:
                lines.append(f"{sub}: missing in README.md (file: {demo[key]!r})")
            elif key not in demo:
                lines.append(f"{sub}: in README.md ({readme[key]!r}) but not in {DEMO.name}")
            else:
                lines.extend(differences(readme[key], demo[key], sub))
        return lines
    if isinstance(readme, list) and isinstance(demo, list) and len(readme) == len(demo):
        return [
            line
            for i, (a, b) in enumerate(zip(readme, demo, strict=True))
            for line in differences(a, b, f"{where}[{i}]")
        ]
    if readme != demo or type(readme) is not type(demo):
        return [f"{where}: README.md has {readme!r}, {DEMO.name} has {demo!r}"]
    return []


def test_differences_name_each_drifted_path() -> None:
    demo = {"cluster": {"devices": 2, "backend": "auto"}, "plan": [1, 2], "name": "x"}
    readme = {"cluster": {"devices": 4, "backend": "auto"}, "plan": [1, 3], "extra": True}
    assert differences(readme, demo) == [
        "cluster.devices: README.md has 4, tiny_ppo.yaml has 2",
        "plan[1]: README.md has 3, tiny_ppo.yaml has 2",
        "name: missing in README.md (file: 'x')",
        "extra: in README.md (True) but not in tiny_ppo.yaml",
    ]
    assert differences(demo, demo) == []
    assert differences({"a": 1}, {"a": 1.0}) == ["a: README.md has 1, tiny_ppo.yaml has 1.0"]


def test_config_block_is_found_under_its_heading() -> None:
    text = "# Intro\n```yaml\na: 0\n```\n## Config format\ntext\n```yaml\na: 1\n```\n```yaml\na: 2\n```\n"
    assert config_block(text) == "a: 1\n"
    with pytest.raises(ValueError, match="no ```yaml block"):
        config_block("## Config format\nnothing here\n")


def test_readme_config_block_is_the_demo_config() -> None:
    readme = yaml.safe_load(config_block(README.read_text(encoding="utf-8")))
    demo = yaml.safe_load(DEMO.read_text(encoding="utf-8"))
    drift = differences(readme, demo)
    assert not drift, (
        f"README.md's config block (under 'Config format') differs from examples/{DEMO.name}; "
        "copy the file into the block:\n  " + "\n  ".join(drift)
    )
