"""Whether the installed Prefect can use its SQLite database, read before its temporary server starts.

Prefect's server migrates its database with Alembic and refuses one whose ``alembic_version`` it does
not know (a newer Prefect migrated it) only after minutes of retries and a traceback per retry. Here
the revision the file holds is compared with the revisions the installed Prefect ships (the files of
its migrations folder, read without importing Prefect's server), so that such a file, or one that is
not an SQLite database at all, ends the run in one line naming the file and the way out, in well
under a second. A file that does not exist yet, has no tables, or holds a revision the installed
Prefect knows (it migrates older ones itself) is left to Prefect.
"""

from __future__ import annotations

import importlib.util
import re
import sqlite3
from pathlib import Path

MIGRATIONS = ("server", "database", "_migrations", "versions", "sqlite")  # inside the prefect package
REVISION = re.compile(r"""^revision\s*=\s*["']([0-9A-Za-z_]+)["']""", re.MULTILINE)
READ_TIMEOUT = 2.0  # seconds to wait for a writer's lock; another run may be using the file


def known_revisions(package_dir: Path | None = None) -> frozenset[str]:
    """The Alembic revisions of the SQLite migrations that the installed Prefect ships (or the
    Prefect package at ``package_dir``)."""
    if package_dir is None:
        spec = importlib.util.find_spec("prefect")
        if spec is None or not spec.submodule_search_locations:
            return frozenset()
        package_dir = Path(next(iter(spec.submodule_search_locations)))
    folder = package_dir.joinpath(*MIGRATIONS)
    return frozenset(
        match.group(1)
        for path in folder.glob("*.py")
        for match in [REVISION.search(path.read_text(encoding="utf-8", errors="replace"))]
        if match
    )


def sqlite_path(connection_url: str) -> Path | None:
    """The file of an SQLite connection URL (``sqlite+aiosqlite:////home/me/.prefect/prefect.db``),
    or None for another database or an in-memory one."""
    scheme, sep, rest = connection_url.partition(":///")
    if not sep or scheme.split("+")[0] != "sqlite":
        return None
    path = rest.split("?")[0]
    return Path(path) if path and path != ":memory:" else None


def stored_revisions(path: Path) -> list[str]:
    """The revisions in the database's ``alembic_version`` table (none for a file without tables);
    raises sqlite3.DatabaseError when the file is not an SQLite database Prefect could open."""
    connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=READ_TIMEOUT)
    try:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "alembic_version" not in tables:
            return []
        return [row[0] for row in connection.execute("SELECT version_num FROM alembic_version")]
    finally:
        connection.close()


def database_problem(path: Path, known: frozenset[str], prefect_version: str) -> str | None:
    """One line saying why Prefect ``prefect_version`` (whose migrations are ``known``) cannot use the
    database at ``path`` and what to do, or None when it can (or the file does not exist yet)."""
    if not path.is_file():
        return None
    way_out = f"move it aside (mv {path} {path}.old) or delete it, and the next run starts a new one"
    try:
        revisions = stored_revisions(path)
    except sqlite3.OperationalError as err:
        if "locked" in str(err):  # another run is writing to it: a usable database
            return None
        return f"Prefect's database {path} cannot be read ({err}); {way_out}"
    except sqlite3.DatabaseError as err:
        return f"Prefect's database {path} is damaged ({err}); {way_out}"
    unknown = sorted(set(revisions) - known) if known else []
    if unknown:
        return (
            f"Prefect's database {path} was migrated by another Prefect version (revision "
            f"{', '.join(unknown)}, unknown to the installed Prefect {prefect_version}); {way_out}, "
            f"or set PREFECT_HOME to another folder"
        )
    return None
