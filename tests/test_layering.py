"""The import rule: ``flows -> tasks -> {storage, nereus_core}``, ``storage -> nereus_core``.

Every ``.py`` file of the four packages is parsed with ``ast`` (nothing is imported),
and every import in it counts, including lazy ones inside functions and
``importlib.import_module("...")`` calls with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nereus_core", "storage", "tasks", "flows")

DASK = {"dask", "distributed"}
PREFECT = {"prefect"}
# Top-level modules each package must never import.
FORBIDDEN: dict[str, set[str]] = {
    "nereus_core": PREFECT | DASK | {"pyarrow", "storage", "tasks", "flows"},
    "storage": PREFECT | DASK | {"tasks", "flows"},
    "tasks": {"flows"},
    "flows": set(),
}
# Dask glue lives in tasks/ only; Prefect client and flow code in flows/ and tasks/ only.
ALLOWED_ONLY_IN: dict[str, set[str]] = {
    **{name: {"tasks"} for name in DASK},
    "prefect": {"flows", "tasks"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module that ``source`` (the text of ``module``) imports."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, node.module] if node.module else parts)
            else:
                base = node.module or ""
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


def _sources() -> list[tuple[str, Path]]:
    return [(pkg, path) for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))]


def violations(package: str, imports: set[str]) -> list[str]:
    problems = []
    for name in sorted(imports):
        top = name.split(".")[0]
        if top in FORBIDDEN[package]:
            problems.append(f"{package} must not import {name}")
        elif top in ALLOWED_ONLY_IN and package not in ALLOWED_ONLY_IN[top]:
            problems.append(f"{name} may be imported only in {sorted(ALLOWED_ONLY_IN[top])}")
    return problems


def test_packages_exist() -> None:
    for pkg in PACKAGES:
        assert (ROOT / pkg / "__init__.py").is_file(), f"{pkg}/__init__.py is missing"


def _id(value: object) -> str:
    return str(value.relative_to(ROOT)) if isinstance(value, Path) else str(value)


@pytest.mark.parametrize(("package", "path"), _sources(), ids=_id)
def test_imports_follow_the_layers(package: str, path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    imports = imported_modules(source, _module_name(path), is_package=path.name == "__init__.py")
    assert violations(package, imports) == [], f"{path.relative_to(ROOT)}"


@pytest.mark.parametrize(
    ("package", "source", "bad"),
    [
        ("nereus_core", "import prefect", "prefect"),
        ("nereus_core", "from distributed import Client", "distributed"),
        ("nereus_core", "def f():\n    import pyarrow.parquet as pq", "pyarrow.parquet"),
        ("nereus_core", "from storage.emu_store import EmuStore", "storage.emu_store"),
        ("storage", "import dask.array", "dask.array"),
        ("storage", "from prefect import task", "prefect"),
        ("tasks", "from flows.cli import main", "flows.cli"),
        ("flows", "from dask.distributed import Client", "dask.distributed"),
        ("nereus_core", "import importlib\nimportlib.import_module('prefect.context')", "prefect.context"),
    ],
)
def test_checker_catches_violations(package: str, source: str, bad: str) -> None:
    imports = imported_modules(source, f"{package}.mod")
    assert bad in imports
    assert violations(package, imports), f"{bad!r} in {package} was not flagged"


def test_relative_imports_resolve() -> None:
    assert imported_modules("from ..flows import cli", "tasks.sub.mod") == {"tasks.flows", "tasks.flows.cli"}
    assert imported_modules("from . import x", "nereus_core.model", is_package=True) == {
        "nereus_core.model",
        "nereus_core.model.x",
    }
    assert "nereus_core.layout" in imported_modules("from .layout import Layout", "nereus_core.config")
    # Climbing out of the package to a sibling top-level package is still an import of it.
    assert violations("tasks", imported_modules("from ... import flows", "tasks.a.b")) != []


def test_allowed_imports_pass() -> None:
    assert violations("tasks", {"dask", "distributed", "prefect", "storage", "nereus_core.config"}) == []
    assert violations("flows", {"prefect", "tasks.device_pool", "storage"}) == []
    assert violations("storage", {"pyarrow", "nereus_core.layout", "torch"}) == []
    assert violations("nereus_core", {"torch", "torch.distributed", "deepspeed", "pydantic"}) == []
