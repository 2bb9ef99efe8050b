"""Hostile YAML the config, CLI and bad-input benchmark are tried on."""

from __future__ import annotations

import itertools


def alias_bomb(levels: int = 9, width: int = 9, *, as_name: bool = False) -> str:
    """The "billion laughs" document: each level a list of ``width`` aliases of the one before
    (9 levels of 9: about 400 bytes that expand to 9**9 values). ``as_name`` makes the last level
    the run's name, so that validating or showing it would walk every value."""
    names = [chr(ord("a") + i) for i in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [{', '.join(['lol'] * width)}]"]
    lines += [f"{n}: &{n} [{', '.join([f'*{p}'] * width)}]" for p, n in itertools.pairwise(names)]
    if as_name:
        lines.append(f"name: *{names[-1]}")
    return "\n".join(lines) + "\n"
