"""Fixtures of the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """One temporary Prefect server (SQLite in a temporary directory) for every test whose flows run
    in-process, as Prefect's testing guide has it: a server takes 10-25 s to start on two cores. The
    flows write their own run directories and read no other flow's runs; tests of the server itself
    (crashes, the CLI's own server) start theirs in a subprocess."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=300):
        yield
