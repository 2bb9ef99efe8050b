"""nereus_core.config.rollout: the deadlines of a vLLM engine's requests grow with their work (tokens to
generate, bytes of weights to load) from a floor, and a deadline that cannot be is refused in one line."""

from __future__ import annotations

from typing import Any

import pytest

from nereus_core.config import ConfigError, parse_config
from nereus_core.config.rollout import DEADLINE_FIELDS, RolloutConfig


def test_deadlines_grow_with_the_work_from_their_floors() -> None:
    cfg = RolloutConfig()
    assert cfg.generate_deadline_s(0) == cfg.generate_timeout_s
    assert (
        cfg.generate_deadline_s(10_000) == cfg.generate_timeout_s + 10_000 * cfg.generate_timeout_s_per_token
    )
    assert cfg.sync_deadline_s(0) == cfg.sync_timeout_s
    assert cfg.sync_deadline_s(2 * 2**30) == pytest.approx(
        cfg.sync_timeout_s + 2 * cfg.sync_timeout_s_per_gib
    )
    # every deadline generous beside what a healthy CPU engine takes (docs/results: start 30-51 s under
    # load, 60-187 tokens/s, a 398 MB sync in 1.9 s)
    assert cfg.start_timeout_s >= 300 and cfg.generate_deadline_s(100_000) > 100_000 / 60
    assert cfg.sync_deadline_s(398 * 10**6) > 10 * 1.9


def test_deadlines_are_set_from_the_config() -> None:
    cfg = parse_config({"rollout": {"generate_timeout_s": 5, "generate_timeout_s_per_token": 0.5}})
    assert cfg.rollout.generate_deadline_s(4) == 7.0
    assert set(RolloutConfig.model_fields) >= DEADLINE_FIELDS  # the fields kept from the engine build


@pytest.mark.parametrize(
    ("rollout", "field"),
    [
        ({"start_timeout_s": 0}, "start_timeout_s"),
        ({"generate_timeout_s": -1}, "generate_timeout_s"),
        ({"generate_timeout_s_per_token": -0.1}, "generate_timeout_s_per_token"),
        ({"sync_timeout_s": 0}, "sync_timeout_s"),
        ({"sync_timeout_s_per_gib": -1}, "sync_timeout_s_per_gib"),
    ],
)
def test_a_deadline_that_cannot_be_is_refused_in_one_line(rollout: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field) as err:
        parse_config({"rollout": rollout})
    assert "\n" not in str(err.value)
