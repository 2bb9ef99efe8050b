"""Hostile or broken input refused in one short line: YAML documents (nereus_core/config/from_yaml.py:
alias bombs, deep nesting, cycles) and the values an error message quotes (``shown``,
nereus_core/config/base.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from nereus_core.config import ConfigError, parse_config, shown
from nereus_core.config.base import SHOWN_CHARS
from nereus_core.config.from_yaml import YAML_MAX_DEPTH, YAML_MAX_VALUES, parse_yaml
from tests.support.hostile_yaml import alias_bomb


def test_an_alias_bomb_is_refused_by_counting_not_by_building() -> None:
    text = alias_bomb()
    assert len(text) < 700
    with pytest.raises(ConfigError, match=f"more than {YAML_MAX_VALUES:,} values through YAML aliases"):
        parse_yaml(text)


def test_aliases_within_the_limit_still_load() -> None:
    data = parse_yaml(alias_bomb(levels=4, width=9))  # 9**4 = 6,561 values: a big but possible config
    assert len(data["d"]) == 9 and data["d"][0][0][0] == ["lol"] * 9


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[" * (YAML_MAX_DEPTH + 1) + "]" * (YAML_MAX_DEPTH + 1), f"nested deeper than {YAML_MAX_DEPTH}"),
        ("a: &a [1, *a]\n", "an alias refers to a list or mapping that contains it"),
        ("a: " + "7" * 5000 + "\n", "not a usable YAML value"),
        ("a: [1, 2\n", "not valid YAML at line"),
        ("a: *nothing\n", "not valid YAML"),
        ("- " * 1 + "x\n" + "y: 1\n", "not valid YAML"),
    ],
)
def test_hostile_or_broken_yaml_is_one_line(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        parse_yaml(text)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_a_deep_document_within_the_limit_loads() -> None:
    depth = YAML_MAX_DEPTH - 1
    data = parse_yaml("[" * depth + "1" + "]" * depth)
    for _ in range(depth):
        data = data[0]
    assert data == 1


def shared_tree(levels: int, width: int = 9) -> list[Any]:
    value: list[Any] = ["lol"] * width
    for _ in range(levels - 1):
        value = [value] * width
    return value


@pytest.mark.parametrize(
    "value",
    [
        shared_tree(9),  # 9**9 leaves, shared: repr() of it would need gigabytes
        "x" * 10_000_000,
        {"k" * 1000: ["v"] * 1000},
        10**5000,  # str() refuses more than 4300 digits
        b"\0" * 1000,
    ],
    ids=["alias-tree", "long-string", "long-key", "huge-int", "bytes"],
)
def test_shown_stays_short_whatever_the_value(value: Any) -> None:
    text = shown(value)
    assert 0 < len(text) <= SHOWN_CHARS


def test_shown_of_a_cycle_is_short() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    assert len(shown(cycle)) <= SHOWN_CHARS


@pytest.mark.parametrize("value", [3, 2.5, None, True, "many", [0, 1], {"a": 1}, ("x", 2)])
def test_shown_of_a_small_value_is_its_repr(value: Any) -> None:
    assert shown(value) == repr(value)


def test_a_bomb_as_a_field_value_gives_a_short_line_quickly() -> None:
    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        parse_config({"job": {"steps": shared_tree(9)}})
    assert time.perf_counter() - started < 1.0
    message = str(info.value)
    assert message.startswith("job.steps=[[[") and len(message) < 200
