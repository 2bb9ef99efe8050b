"""Fixtures of the tasks tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks.runtime.device_pool import DevicePool


@pytest.fixture(scope="module")
def pool() -> Iterator[DevicePool]:
    """A pool of 4 device slots for a whole test module (a module may define its own instead)."""
    with DevicePool(4) as pool:
        yield pool
