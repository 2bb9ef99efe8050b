"""tasks/rollout_engines.py without an engine: vLLM's weight hand-over is one machine's shared memory,
so engines or actor/train devices on another machine are refused in one line."""

from __future__ import annotations

import types

import pytest

from tasks import rollout_engines


def _pool(*addresses: str) -> object:
    return types.SimpleNamespace(workers=tuple(addresses))


def test_devices_on_the_driver_s_machine_pass() -> None:
    rollout_engines.on_this_machine(_pool("tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002"), [0, 1], "x")


def test_a_device_on_another_machine_is_one_line_naming_it_and_the_way_out() -> None:
    pool = _pool("tcp://127.0.0.1:4001", "tcp://192.0.2.7:4002")  # TEST-NET-1: never this machine
    with pytest.raises(ValueError) as err:
        rollout_engines.on_this_machine(pool, [0, 1], "actor/generate")
    line = str(err.value)
    assert "\n" not in line and "slot 1 on 192.0.2.7" in line and "slot 0" not in line
    assert "actor/generate" in line and "rollout.engine: nereus" in line
    rollout_engines.on_this_machine(pool, [0], "actor/generate")  # the slots asked about only
