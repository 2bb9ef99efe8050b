"""Reading the project's sources for the layering tests: every import of a module, parsed with ``ast``."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("nereus_core", "storage", "tasks", "flows")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def from_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` statement imports from."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module that ``source`` (the text of ``module``) imports."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            if base:
                found.add(base)
            # `from . import x` and `from pkg import sub` may import submodules.
            found.update(f"{base}.{alias.name}" if base else alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and _call_name(node.func) in {"import_module", "__import__"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def sources() -> list[tuple[str, Path]]:
    return [(pkg, path) for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))]


@cache
def project_sources() -> dict[str, tuple[Path, str]]:
    """Module name -> (path, text) of every module of the four packages."""
    return {module_name(path): (path, path.read_text(encoding="utf-8")) for _, path in sources()}
