"""A user's reward file (``reward.function: path/to/file.py:function``): its path checked without
running anything (``path_problem``, in the driver), and the file imported and its function checked
(``load_function``, only ever in a reward worker process: ``nereus_core.rewards.worker``).

Boundary: stdlib only, so that a worker process starts without the rest of Nereus (torch and all).
Importing the file executes it, as verl does with ``custom_reward_function``.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

USER_FORM = "path/to/file.py:function"


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


def path_problem(path: Path) -> str | None:
    """Why ``path`` is not a file to import (it does not exist, is a directory), or None; reads the
    file system only."""
    if path.is_file():
        return None
    where = "is a directory" if path.is_dir() else "does not exist"
    return f"{path} {where}; give the path of a .py file (relative to where nereus runs)"


def load_module(path: Path) -> Any:
    """Import the file at ``path`` as a module of its own, not added to ``sys.modules``: a process
    that needs the function (a worker) resolves the spec itself rather than unpickling it."""
    problem = path_problem(path)
    if problem:
        raise ValueError(problem)
    spec = importlib.util.spec_from_file_location(f"nereus_user_reward_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as err:  # the user's code: any error, or an exit, as one line
        raise ValueError(f"importing {path} raised {type(err).__name__}: {first_line(err)}") from None
    return module


def check_signature(fn: Callable[..., Any], spec: str) -> None:
    """verl calls ``fn(data_source, solution_str, ground_truth, extra_info)``; refuse one that cannot
    take four positional arguments."""
    try:
        inspect.signature(fn).bind("source", "solution", "truth", {})
    except TypeError:
        raise ValueError(
            f"{spec} cannot be called as fn(data_source, solution_str, ground_truth, extra_info)"
        ) from None
    except ValueError:  # no signature to inspect (some builtins): let the first call tell
        pass


def load_function(spec: str) -> Callable[..., Any]:
    """The function ``path.py:name`` names, imported and checked; ValueError with one line."""
    path_text, _, name = spec.rpartition(":")
    module = load_module(Path(path_text))
    if not hasattr(module, name):
        raise ValueError(f"{path_text} has no function {name!r}; define it or fix the name after ':'")
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"{path_text}:{name} is a {type(fn).__name__}, not a function")
    check_signature(fn, spec)
    return fn  # type: ignore[no-any-return]


__all__ = ["USER_FORM", "check_signature", "first_line", "load_function", "load_module", "path_problem"]
