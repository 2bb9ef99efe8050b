"""A Prefect database the installed Prefect cannot use is refused in one line before Prefect's
temporary server starts (flows/cli/prefect_db.py), and ``nereus`` keeps its Prefect state in a home of
its own (flows/cli/prefect_server.py).

Each database here is made in a temporary folder: another Prefect version's migration (an
``alembic_version`` row the installed Prefect does not ship) and a damaged file (bytes that are no
SQLite database). ``nereus run`` answers each in one line with exit status 2 within seconds; before
this check, Prefect's server retried the migration for about 3 minutes with a traceback each time.
The real ``~/.prefect`` and ``~/.nereus`` are never touched: every ``nereus`` here runs with
PREFECT_HOME or HOME in a temporary folder.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.cli import prefect_db

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny_ppo.yaml"
ANSWER_WITHIN = 30.0  # seconds, the most a refusal may take; the check itself takes milliseconds
# ``nereus run`` up to its refusal: about 3 s on an idle two-core machine, 17-25 s measured on one
# busy with a pip install; Prefect's own answer (retries, then a timeout) took about 3 minutes. The
# whole command is held to the same 30 s a user is promised.
RUN_ANSWER_WITHIN = ANSWER_WITHIN
NEWER_REVISION = "f0f0f0f0f0f0"  # no Prefect release ships it


def _database(path: Path, revision: str | None) -> Path:
    """An SQLite file shaped like Prefect's: an ``alembic_version`` table holding ``revision``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        if revision is not None:
            connection.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
    connection.close()
    return path


def _damaged(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(range(256)) * 16)  # not an SQLite header
    return path


def _nereus_run(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """``nereus run`` of the demo config with Prefect's and Nereus's variables cleared, then ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "NEREUS_"))}
    full |= {"PYTHONPATH": str(ROOT)} | env
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli.main", "run", str(EXAMPLE), "--out", str(tmp_path / "run")],
        cwd=tmp_path,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - started


def _one_line_refusal(done: subprocess.CompletedProcess[str], elapsed: float, path: Path) -> str:
    assert done.returncode == 2, done
    assert elapsed < RUN_ANSWER_WITHIN, f"answered after {elapsed:.1f} s"
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert str(path) in lines[0] and f"mv {path} {path}.old" in lines[0], lines[0]
    return lines[0]


def test_the_installed_prefect_ships_its_revisions() -> None:
    known = prefect_db.known_revisions()
    assert "9725c1cbee35" in known, sorted(known)[:5]  # Prefect's initial SQLite migration
    assert len(known) > 50 and NEWER_REVISION not in known


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite+aiosqlite:////home/me/.nereus/prefect.db", Path("/home/me/.nereus/prefect.db")),
        ("sqlite:///prefect.db?timeout=5", Path("prefect.db")),
        ("sqlite+aiosqlite:///:memory:", None),
        ("postgresql+asyncpg://user:pw@db:5432/prefect", None),
    ],
)
def test_only_an_sqlite_file_is_checked(url: str, path: Path | None) -> None:
    assert prefect_db.sqlite_path(url) == path


def test_a_database_of_another_prefect_version_is_one_line(tmp_path: Path) -> None:
    path = _database(tmp_path / "prefect.db", NEWER_REVISION)
    started = time.monotonic()
    line = prefect_db.database_problem(path, prefect_db.known_revisions(), "3.0.0")
    assert time.monotonic() - started < ANSWER_WITHIN
    assert line is not None and "\n" not in line, line
    assert f"Prefect's database {path} was migrated by another Prefect version" in line, line
    assert f"revision {NEWER_REVISION}, unknown to the installed Prefect 3.0.0" in line, line
    assert f"mv {path} {path}.old" in line and "PREFECT_HOME" in line, line


def test_a_damaged_database_is_one_line(tmp_path: Path) -> None:
    path = _damaged(tmp_path / "prefect.db")
    line = prefect_db.database_problem(path, prefect_db.known_revisions(), "3.0.0")
    assert line is not None and "\n" not in line, line
    assert f"Prefect's database {path} is damaged (file is not a database)" in line, line
    assert f"mv {path} {path}.old" in line, line


def test_a_database_the_installed_prefect_can_use_passes(tmp_path: Path) -> None:
    known = prefect_db.known_revisions()
    empty = tmp_path / "empty.db"
    empty.touch()
    assert prefect_db.database_problem(tmp_path / "absent.db", known, "3") is None  # a first run
    assert prefect_db.database_problem(empty, known, "3") is None  # Prefect creates its tables
    assert prefect_db.database_problem(_database(tmp_path / "new.db", None), known, "3") is None
    for revision in sorted(known)[:3]:  # an older revision: Prefect migrates it forward itself
        path = _database(tmp_path / f"{revision}.db", revision)
        assert prefect_db.database_problem(path, known, "3") is None, revision


# A newer revision by default: the check itself (test_a_database_of_another_prefect_version_is_one_line)
@pytest.mark.parametrize("damage", [pytest.param("newer-revision", marks=pytest.mark.slow), "garbage"])
def test_nereus_run_refuses_an_unusable_database_in_one_line(tmp_path: Path, damage: str) -> None:
    home = tmp_path / "prefect-home"
    path = home / "prefect.db"
    if damage == "newer-revision":
        _database(path, NEWER_REVISION)
    else:
        _damaged(path)
    done, elapsed = _nereus_run(tmp_path, {"PREFECT_HOME": str(home)})
    _one_line_refusal(done, elapsed, path)
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # free once the socket closes: nothing listens there


def test_nereus_keeps_its_prefect_state_in_its_own_home(tmp_path: Path) -> None:
    """With neither PREFECT_HOME nor PREFECT_API_URL set, the database checked (and used) is
    ~/.nereus/prefect/prefect.db, not the one another Prefect left in ~/.prefect."""
    _database(tmp_path / ".prefect" / "prefect.db", NEWER_REVISION)  # another Prefect's, newer
    ours = _damaged(tmp_path / ".nereus" / "prefect" / "prefect.db")
    done, elapsed = _nereus_run(tmp_path, {"HOME": str(tmp_path)})
    line = _one_line_refusal(done, elapsed, ours)
    assert "is damaged" in line, line
    ours.unlink()  # a usable home: Prefect's own ~/.prefect profile is still read (an API to use)
    url = f"http://127.0.0.1:{_closed_port()}/api"
    (tmp_path / ".prefect" / "profiles.toml").write_text(
        f'active = "mine"\n\n[profiles.mine]\nPREFECT_API_URL = "{url}"\n'
    )
    done, _ = _nereus_run(tmp_path, {"HOME": str(tmp_path)})
    assert done.returncode == 2 and f"{url} (PREFECT_API_URL of Prefect profile 'mine')" in done.stderr, done
