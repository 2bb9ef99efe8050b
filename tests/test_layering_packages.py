"""The sub-packages' own boundaries, the size of nereus_core's top level, and the size guides.

- the Dask runtime (``tasks/runtime``) imports no Prefect and none of the Prefect tasks above it;
- the RL maths (``nereus_core/rl``) imports no engine, controller or GTG; the cost model no controller;
  the config nothing that runs a job;
- ``nereus_core/`` keeps at most ten top-level modules. The reason for a cap: a reader looks for a
  concern by folder (config/, controller/, cost/, rl/, engine/, sim/, ...), and a loose module at
  the top is one more place to look; once three modules belong together they become a subpackage
  (STYLE.md). Ten is the room the few shared nouns (``plan``, ``layout``, ``emu``, ``job``, ...)
  need; reaching it means grouping, not raising it;
- the size guides, for the source packages and ``benchmarks/`` (tests exempt): a file past
  ``MAX_FILE_LINES`` or a function past ``MAX_FUNCTION_LINES`` (its ``def`` line to its last line,
  docstring included) is a sign that it holds more than one responsibility. Split by
  responsibility (one class in one file; a long loop body into named steps), not by line count.
"""

from __future__ import annotations

import ast

import pytest

from tests.support.source_imports import PACKAGES, ROOT, imported_modules, project_sources

# Sub-package -> module prefixes it must never import (lazy imports included).
SUBPACKAGE_FORBIDDEN: dict[str, tuple[str, ...]] = {
    # The Dask runtime is plain Dask: Prefect's tasks and flows sit above it.
    "tasks.runtime": ("prefect", "flows", "tasks.step_tasks", "tasks.job_ops", "tasks.transition_ops"),
    # The RL maths is pure tensor code: no device runtime, no model engine, no controller.
    "nereus_core.rl": ("nereus_core.engine", "nereus_core.controller", "nereus_core.gtg", "deepspeed"),
    # The cost model prices plans; the controller that decides with it sits above it.
    "nereus_core.cost": ("nereus_core.controller", "nereus_core.job", "nereus_core.engine"),
    # The config validates itself; nothing that runs a job is below it.
    "nereus_core.config": (
        "nereus_core.controller",
        "nereus_core.cost",
        "nereus_core.engine",
        "nereus_core.job",
    ),
}
MAX_TOP_LEVEL_CORE_MODULES = 10
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60
GUIDED_ROOTS = (*PACKAGES, "benchmarks")  # tests are exempt: a test's table of cases may be long


def subpackage_violations(module: str, imports: set[str]) -> list[str]:
    problems = []
    for package, banned in SUBPACKAGE_FORBIDDEN.items():
        if module == package or module.startswith(package + "."):
            problems += [
                f"{module} must not import {name}"
                for name in sorted(imports)
                if any(name == b or name.startswith(b + ".") for b in banned)
            ]
    return problems


@pytest.mark.parametrize("module", sorted(project_sources()), ids=str)
def test_subpackages_keep_their_boundaries(module: str) -> None:
    path, source = project_sources()[module]
    imports = imported_modules(source, module, is_package=path.name == "__init__.py")
    assert subpackage_violations(module, imports) == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("tasks.runtime.device_pool", "from prefect import task"),
        ("tasks.runtime.cluster", "def f():\n    from tasks.step_tasks import generate"),
        ("nereus_core.rl.ppo", "from nereus_core.engine.train import train_step"),
        ("nereus_core.cost.stage_cost", "from nereus_core.controller.state import ControllerState"),
        ("nereus_core.config.job", "from nereus_core.cost.hardware import H100_SXM"),
    ],
)
def test_subpackage_checker_catches_violations(module: str, source: str) -> None:
    assert subpackage_violations(module, imported_modules(source, module)) != []


def test_nereus_core_has_few_top_level_modules() -> None:
    top = sorted(p.name for p in (ROOT / "nereus_core").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_CORE_MODULES, f"nereus_core/ has {len(top)} top-level modules: {top}"


def long_file(path: str, source: str) -> list[str]:
    """``path`` named with its line count if it is past the file guide."""
    n = len(source.splitlines())
    return [f"{path}: {n} lines (guide: {MAX_FILE_LINES})"] if n > MAX_FILE_LINES else []


def long_functions(path: str, source: str) -> list[str]:
    """Every function or method of ``source`` past the function guide, as ``path:qualified.name``
    with its line count (``def`` line to last line; a nested function counts in its parent too)."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (child.end_lineno or child.lineno) - child.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(f"{path}:{name} ({n} lines)")
            visit(child, f"{name}." if name != prefix else prefix)

    visit(ast.parse(source), "")
    return found


def _guided_sources() -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
        for root in GUIDED_ROOTS
        for path in sorted((ROOT / root).rglob("*.py"))
    ]


def test_no_source_file_is_past_the_file_guide() -> None:
    assert [line for path, source in _guided_sources() for line in long_file(path, source)] == []


def test_no_function_is_past_the_function_guide() -> None:
    long = [line for path, source in _guided_sources() for line in long_functions(path, source)]
    assert long == []


def test_the_file_guide_catches_a_long_file() -> None:
    assert long_file("a.py", "x = 1\n" * MAX_FILE_LINES) == []
    over = long_file("a.py", "x = 1\n" * (MAX_FILE_LINES + 1))
    assert over == [f"a.py: {MAX_FILE_LINES + 1} lines (guide: {MAX_FILE_LINES})"]


def test_the_function_guide_catches_a_long_function_method_and_nested_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))  # + the def line: at the guide
    fits = f"def f():\n{body}"
    assert long_functions("a.py", fits) == []
    over = f"def f():\n{body}    return x0\n"
    assert long_functions("a.py", over) == [f"a.py:f ({MAX_FUNCTION_LINES + 1} lines)"]
    method = "class C:\n" + "\n".join("    " + line for line in over.splitlines())
    assert long_functions("a.py", method) == ["a.py:C.f (61 lines)"]
    nested = "def outer():\n" + "\n".join("    " + line for line in over.splitlines())
    assert long_functions("a.py", nested) == ["a.py:outer (62 lines)", "a.py:outer.f (61 lines)"]
