"""The layering rules that code structure must keep, checked on the source.

- imports run ``flows -> tasks -> {storage, nereus_core}``, ``storage -> nereus_core``;
- Prefect tasks are made in ``tasks/``, flows in ``flows/``;
- one module imports Dask (``tasks/runtime/cluster.py``);
- ``nereus_core`` never reads or sets environment variables;
- no import cycles among the project's modules.

Every ``.py`` file of the four packages is parsed with ``ast`` (nothing is imported),
and every import in it counts, including lazy ones inside functions, those under
``TYPE_CHECKING`` and ``importlib.import_module("...")`` calls with a literal name.
Each checker is also run on small fake sources, to show that it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.source_imports import (
    PACKAGES,
    ROOT,
    from_base,
    imported_modules,
    module_name,
    project_sources,
    sources,
)

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


@pytest.mark.parametrize(("package", "path"), sources(), ids=_id)
def test_imports_follow_the_layers(package: str, path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    imports = imported_modules(source, module_name(path), is_package=path.name == "__init__.py")
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
        ("tasks", "from flows.cli.main import main", "flows.cli.main"),
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
    assert violations("flows", {"prefect", "tasks.runtime.device_pool", "storage"}) == []
    assert violations("storage", {"pyarrow", "nereus_core.layout", "torch"}) == []
    assert violations("nereus_core", {"torch", "torch.distributed", "deepspeed", "pydantic"}) == []


# ------------------------------------------------------------- the rules beyond layers

DECORATOR_HOME = {"task": "tasks", "flow": "flows"}  # a Prefect task is defined in tasks/, a flow in flows/
ENVIRONMENT = {"environ", "environb", "getenv", "putenv", "unsetenv"}


def prefect_decorators(source: str) -> list[tuple[str, int]]:
    """``(task|flow, line)`` of every Prefect task or flow made in ``source``: decorators and calls
    (``task(fn)``), through ``from prefect import task [as x]`` or ``import prefect [as p]``."""
    tree = ast.parse(source)
    names: dict[str, str] = {}  # local name -> task | flow
    modules: set[str] = set()  # local names of the prefect module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "prefect" and not node.level:
            names.update({a.asname or a.name: a.name for a in node.names if a.name in DECORATOR_HOME})
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name == "prefect")

    def kind(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Call):
            expr = expr.func
        if isinstance(expr, ast.Name):
            return names.get(expr.id)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id in modules:
            return expr.attr if expr.attr in DECORATOR_HOME else None
        return None

    found = set()
    for node in ast.walk(tree):
        exprs = list(getattr(node, "decorator_list", [])) + ([node] if isinstance(node, ast.Call) else [])
        found.update((k, e.lineno) for e in exprs if (k := kind(e)) is not None)
    return sorted(found, key=lambda item: item[1])


def misplaced_decorators(module: str, source: str) -> list[str]:
    package = module.split(".")[0]
    return [
        f"{module}:{line}: a Prefect {kind} belongs in {DECORATOR_HOME[kind]}/"
        for kind, line in prefect_decorators(source)
        if package != DECORATOR_HOME[kind]
    ]


def environment_uses(source: str) -> list[int]:
    """Lines of ``source`` that read or change the process environment (``os.environ``, ``os.getenv``...)."""
    tree = ast.parse(source)
    os_names = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name == "os"
    }
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and not node.level:
            lines += [node.lineno] if any(a.name in ENVIRONMENT for a in node.names) else []
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in ENVIRONMENT
            and isinstance(node.value, ast.Name)
            and node.value.id in os_names
        ):
            lines.append(node.lineno)
    return sorted(lines)


def dask_importers(sources: dict[str, str]) -> set[str]:
    """Modules among ``sources`` (name -> text) that import dask or distributed, lazily or not."""
    return {
        module
        for module, text in sources.items()
        if any(name.split(".")[0] in DASK for name in imported_modules(text, module))
    }


def _import_edges(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` imports. ``from pkg import sub`` is an edge to the
    submodule ``pkg.sub`` when there is one, else to ``pkg`` (its ``__init__`` runs for the name)."""
    package = module if is_package else module.rpartition(".")[0]
    edges: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            subs = {f"{base}.{a.name}" for a in node.names} & known
            edges |= subs | ({base} if len(subs) < len(node.names) else set())
        elif isinstance(node, ast.Import | ast.Call):
            edges |= imported_modules(ast.unparse(node), module, is_package)  # plain and importlib
    return edges & known


def import_cycle(sources: dict[str, str], packages: set[str] = frozenset()) -> list[str] | None:
    """One import cycle among ``sources`` (name -> text) as ``[a, b, ..., a]``, or None.

    Every import counts: lazy ones in functions and those under ``TYPE_CHECKING`` too.
    ``packages`` names the modules that are packages (``__init__``), for relative imports.
    """
    graph = {
        module: sorted(_import_edges(text, module, module in packages, set(sources)) - {module})
        for module, text in sources.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for name in graph[module]:
            if state.get(name) == 1:
                return [*path[path.index(name) :], name]
            if name not in state and (cycle := visit(name)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


@pytest.mark.parametrize(("package", "path"), sources(), ids=_id)
def test_prefect_tasks_live_in_tasks_and_flows_in_flows(package: str, path: Path) -> None:
    module = module_name(path)
    assert misplaced_decorators(module, path.read_text(encoding="utf-8")) == []


def test_dask_is_imported_by_one_module() -> None:
    sources = {m: text for m, (_, text) in project_sources().items()}
    assert dask_importers(sources) == {"tasks.runtime.cluster"}


# The one exception: a reward worker's environment is copied, name by name as the config lists them,
# from the driver's into the child's (one line); no setting is read from it.
CHILD_ENVIRONMENT = "nereus_core/rewards/isolation.py"


def test_nereus_core_never_touches_the_environment() -> None:
    found = {
        str(path.relative_to(ROOT)): lines
        for module, (path, text) in project_sources().items()
        if module.split(".")[0] == "nereus_core" and (lines := environment_uses(text))
    }
    assert len(found.pop(CHILD_ENVIRONMENT, [])) <= 1
    assert found == {}, "nereus_core reads or sets environment variables; pass the values in"


def test_no_import_cycles() -> None:
    sources = project_sources()
    packages = {m for m, (path, _) in sources.items() if path.name == "__init__.py"}
    cycle = import_cycle({m: text for m, (_, text) in sources.items()}, packages)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# Each rule's checker, shown able to fail on small fake sources.


def test_decorator_checker_catches_misplaced_tasks_and_flows() -> None:
    source = (
        "from prefect import task as t, flow\nimport prefect as p\n"
        "@t(retries=1)\ndef a(): ...\n@flow\ndef b(): ...\n@p.task\ndef c(): ...\nd = t(len)\n"
    )
    assert prefect_decorators(source) == [("task", 3), ("flow", 5), ("task", 7), ("task", 9)]
    assert len(misplaced_decorators("flows.x", source)) == 3
    assert len(misplaced_decorators("tasks.x", source)) == 1
    assert misplaced_decorators("nereus_core.x", source) != []
    assert misplaced_decorators("tasks.x", "from prefect import task\n@task\ndef a(): ...\n") == []
    assert prefect_decorators("from functools import cache\n@cache\ndef task(): ...\n") == []


def test_environment_checker_catches_reads_and_writes() -> None:
    assert environment_uses("import os\nx = os.environ.get('A')\n") == [2]
    assert environment_uses("import os as o\ndef f():\n    return o.getenv('A')\n") == [3]
    assert environment_uses("from os import environ\n") == [1]
    assert environment_uses("import os\nos.putenv('A', '1')\n") == [2]
    assert environment_uses("import os\np = os.path.join('a')\nenviron = {}\n") == []


def test_dask_checker_counts_every_importing_module() -> None:
    sources = {
        "tasks.a": "from distributed import Client",
        "tasks.b": "def f():\n    import dask.array",
        "tasks.c": "import torch.distributed",
    }
    assert dask_importers(sources) == {"tasks.a", "tasks.b"}


def test_cycle_checker_names_a_cycle_lazy_or_type_checking() -> None:
    lazy = {"p.a": "from p.b import x", "p.b": "def f():\n    from p.c import y", "p.c": "import p.a"}
    assert import_cycle(lazy) == ["p.a", "p.b", "p.c", "p.a"]
    typing_only = {
        "p.a": "from p.b import x",
        "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import W",
    }
    assert import_cycle(typing_only) == ["p.a", "p.b", "p.a"]
    relative = {"p": "from .a import x", "p.a": "from . import b", "p.b": "import os"}
    assert import_cycle(relative, packages={"p"}) is None
    relative["p.b"] = "from p import x"
    assert import_cycle(relative, packages={"p"}) == ["p", "p.a", "p.b", "p"]
