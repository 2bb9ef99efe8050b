"""How a ``nereus`` command that runs a flow meets Prefect, before the flow starts.

    prefect_defaults()  environment defaults and Nereus's own Prefect home, set before Prefect is
                        first imported
    api_problem()       a configured PREFECT_API_URL that does not answer, or (no URL) a database the
                        installed Prefect cannot use (flows/cli/prefect_db.py) -> one line (exit 2)
    flows.cli.watchdog  a local run's temporary server dies with the driver

No PREFECT_API_URL (Prefect's "ephemeral" profile, the default): each run starts Prefect's temporary
server as a child process and the watchdog stops it if the driver dies. A configured URL: the
server must answer ``/health`` within ``HEALTH_TIMEOUT`` seconds, else the run ends in one line
saying which URL and how to start the server or go back to the temporary one. Flow runs send a
heartbeat every ``HEARTBEAT_SECONDS``; the automation in prefect/automations/ marks a run whose
heartbeats stop as Crashed, so that the UI offers Retry.

Prefect's home (its SQLite database, results, logs) is ``~/.nereus/prefect`` unless PREFECT_HOME or
PREFECT_API_URL is set in the environment: a database there is migrated by Nereus's locked Prefect
only, never by another Prefect on the machine (``~/.prefect``, Prefect's own default, may hold one
from a newer version that this Prefect cannot open). Prefect's profiles are still read from
``~/.prefect/profiles.toml``, so that ``prefect profile use`` and ``prefect config set`` apply.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

from flows.cli import prefect_db

API_URL_ENV = "PREFECT_API_URL"
HOME_ENV = "PREFECT_HOME"
PROFILES_ENV = "PREFECT_PROFILES_PATH"
NEREUS_PREFECT_HOME = Path("~/.nereus/prefect")
PREFECT_PROFILES = Path("~/.prefect/profiles.toml")  # Prefect's default, wherever its home is
HEARTBEAT_ENV = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
HEARTBEAT_SECONDS = 30  # Prefect's minimum; the automation expects one within 90 s (three missed)
HEALTH_TIMEOUT = 2.0  # seconds; a local or LAN server answers /health in milliseconds

DEFAULTS = {
    # Prefect's temporary server gets 20 s to start by default; a busy 2-core machine can need more.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    HEARTBEAT_ENV: str(HEARTBEAT_SECONDS),
}


def prefect_defaults() -> None:
    """Set Nereus's defaults for Prefect where the environment does not set them already; Prefect
    reads its settings when first imported, so this runs before that."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    use_nereus_home()


def use_nereus_home() -> None:
    """Point Prefect at ``~/.nereus/prefect`` unless the environment names a home or an API of its
    own. A process that has imported Prefect already (Nereus called from Python, the tests) keeps
    the settings Prefect has read, and its children too."""
    if "prefect" in sys.modules or any(os.environ.get(key, "").strip() for key in (HOME_ENV, API_URL_ENV)):
        return
    home = NEREUS_PREFECT_HOME.expanduser()
    home.mkdir(parents=True, exist_ok=True)
    os.environ[HOME_ENV] = str(home)
    os.environ.setdefault(PROFILES_ENV, str(PREFECT_PROFILES.expanduser()))


def database_problem() -> str | None:
    """One line saying that the SQLite database of Prefect's temporary server is one the installed
    Prefect cannot use (another version's migration, a damaged file) and what to do, or None."""
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    path = prefect_db.sqlite_path(url.get_secret_value() if url is not None else "")
    if path is None:
        return None
    return prefect_db.database_problem(path, prefect_db.known_revisions(), metadata.version("prefect"))


def configured_api_url() -> str | None:
    """The Prefect API URL the flow would use (environment, profile or prefect.toml), or None when
    Prefect would start its temporary server."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url).rstrip("/") if url else None


def _where() -> tuple[str, str]:
    """Where the URL was set and how to go back to the temporary server, for the error line."""
    if os.environ.get(API_URL_ENV, "").strip():
        return f"{API_URL_ENV} in the environment", f"unset {API_URL_ENV}"
    from prefect.context import get_settings_context

    profile = get_settings_context().profile
    if any(getattr(key, "name", key) == API_URL_ENV for key in profile.settings):
        return f"{API_URL_ENV} of Prefect profile '{profile.name}'", "run 'prefect profile use ephemeral'"
    return f"{API_URL_ENV} in Prefect's settings", f"remove {API_URL_ENV} from prefect.toml or .env"


def health_problem(url: str, *, timeout: float = HEALTH_TIMEOUT) -> str | None:
    """Why the Prefect API at ``url`` does not answer, or None when it does. Any HTTP answer counts
    as an answer (a server that wants a key is there); no connection or no answer in ``timeout``
    seconds does not."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as err:
        reason = err.reason
        return getattr(reason, "strerror", None) or str(reason)
    except (TimeoutError, OSError) as err:
        return f"no answer within {timeout:g} s" if isinstance(err, TimeoutError) else str(err)
    except ValueError as err:  # not a URL urllib can open
        return f"not a URL: {err}"


def api_problem() -> str | None:
    """One line saying that the configured Prefect API does not answer and what to do, or None
    (no URL configured, or it answers). With no URL configured, the temporary server's database is
    checked instead (``database_problem``)."""
    url = configured_api_url()
    if url is None:
        return database_problem()
    why = health_problem(url)
    if why is None:
        return None
    where, back = _where()
    return (
        f"the Prefect API at {url} ({where}) does not answer ({why}); start it with "
        f"'prefect server start', or {back} to go back to a temporary local server per run"
    )
