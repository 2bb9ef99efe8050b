"""The sub-packages' own boundaries, the size of nereus_core's top level and of every source file.

- the Dask runtime (``tasks/runtime``) imports no Prefect and none of the Prefect tasks above it;
- the RL maths (``nereus_core/rl``) imports no engine, controller or GTG; the cost model no controller;
  the config nothing that runs a job;
- ``nereus_core/`` keeps at most ten top-level modules; no source file is over 400 lines.
"""

from __future__ import annotations

import pytest

from tests.support.source_imports import PACKAGES, ROOT, imported_modules, project_sources

# Sub-package -> module prefixes it must never import (lazy imports included).
SUBPACKAGE_FORBIDDEN: dict[str, tuple[str, ...]] = {
    # The Dask runtime is plain Dask: Prefect's tasks and flows sit above it.
    "tasks.runtime": ("prefect", "flows", "tasks.stages", "tasks.job_ops", "tasks.transition_ops"),
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
MAX_LINES = 400


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
        ("tasks.runtime.cluster", "def f():\n    from tasks.stages import generate"),
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


def test_no_source_file_is_over_the_size_limit() -> None:
    roots = [*PACKAGES, "tests", "benchmarks"]
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for root in roots
        for path in sorted((ROOT / root).rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    ]
    assert long == []
