"""The simulated world shares no code with the cost model or the controller, either way: importing the
world's modules loads nothing of ``nereus_core.cost`` or ``nereus_core.controller``, and importing every
module of those loads nothing of the world. So the world's memory, step rule, generation and
transitions can show the cost model wrong."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import nereus_core.controller
import nereus_core.cost

WORLD = (
    "nereus_core.sim.world",
    "nereus_core.sim.stage_world",
    "nereus_core.sim.memory",
    "nereus_core.sim.transitions",
    "nereus_core.sim.checkpoints",
    "nereus_core.sim.shapes",
    "nereus_core.sim.splits",
    "nereus_core.sim.trace",
    "nereus_core.sim.noise",
)


def _loaded_after(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    """The modules starting with ``prefixes`` a fresh interpreter holds after importing ``modules``."""
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print('\\n'.join(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_world_imports_nothing_of_the_cost_model_or_the_controller() -> None:
    loaded = _loaded_after(list(WORLD), ("nereus_core.cost", "nereus_core.controller"))
    assert loaded == []


def test_the_cost_model_and_the_controller_import_nothing_of_the_world() -> None:
    theirs = [
        m.name
        for pkg in (nereus_core.cost, nereus_core.controller)
        for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")
    ]
    assert len(theirs) > 10  # every module of both packages, found
    assert _loaded_after(theirs, ("nereus_core.cost",))  # the probe sees what it imports
    assert set(_loaded_after(theirs, WORLD)) == set()
