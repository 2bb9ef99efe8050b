"""A config's YAML text read with limits: safe types only, a bounded number of values (aliases
expanded) and a bounded depth, so a hostile document is refused in one line before it is built.

Boundary: text in, plain Python data out (``parse_config`` validates it); no files, no environment.
"""

from __future__ import annotations

from typing import Any

import yaml

from nereus_core.config import ConfigError, shown

# A config is a few dozen values a few levels deep; these leave room for long scenarios and plans of
# thousands of slots while refusing alias bombs ("billion laughs": 9 levels of 9 aliases expand to
# 9**9 values from 600 bytes) and nesting deep enough to exhaust the composer's recursion.
YAML_MAX_VALUES = 100_000  # values in the document once every alias is expanded
YAML_MAX_DEPTH = 64  # nesting of lists and mappings


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts values (aliases expanded) and depth while composing, so a
    document past the limits is refused before any Python object of it is built."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._values = 0
        self._depth = 0
        self._sizes: dict[int, int] = {}  # id(node) -> its values, aliases expanded

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > YAML_MAX_DEPTH:
                raise ConfigError(
                    f"refused: nested deeper than {YAML_MAX_DEPTH} levels; a config needs a few"
                )
            if self.check_event(yaml.AliasEvent):
                target = self.anchors.get(self.peek_event().anchor)
                if target is not None:
                    size = self._sizes.get(id(target))
                    if size is None:  # the alias sits inside the node it names
                        raise ConfigError("refused: an alias refers to a list or mapping that contains it")
                    self._count(size)
                return super().compose_node(parent, index)
            before = self._count(1)
            node = super().compose_node(parent, index)
            self._sizes[id(node)] = self._values - before + 1
            return node
        finally:
            self._depth -= 1

    def _count(self, values: int) -> int:
        """Add ``values`` to the document's count (refused past the limit); the count before."""
        before = self._values
        self._values += values
        if self._values > YAML_MAX_VALUES:
            raise ConfigError(
                f"refused: expands to more than {YAML_MAX_VALUES:,} values through YAML aliases "
                "(&anchor / *alias) or sheer size; a config needs far fewer"
            )
        return before


def parse_yaml(text: str) -> Any:
    """The YAML document in ``text`` (safe types only), within ``YAML_MAX_VALUES`` and
    ``YAML_MAX_DEPTH``; ``ConfigError`` with one line if it is not valid YAML or too big."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"not valid YAML{at}: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"not valid YAML: {' '.join(str(err).split())}") from None
    except (ValueError, OverflowError, RecursionError) as err:  # e.g. int() of 5,000 digits
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"not a usable YAML value: {shown(str(err).split(':')[0], 120)}") from None
    finally:
        loader.dispose()


__all__ = ["YAML_MAX_DEPTH", "YAML_MAX_VALUES", "parse_yaml"]
