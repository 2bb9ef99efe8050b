"""flows/job/engine_switch.py's probe check, without an engine: two engine sets agree when every token
both chose after the same prefix has the same log-prob within the tolerance of the model's dtype."""

from __future__ import annotations

import torch

from flows.job.engine_switch import PROBE_TOLERANCE, probe_agreement

IDS = torch.tensor([[3, 5, 7, 9], [2, 4, 6, 8]])
LOGP = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.1, -0.2, -0.3, -0.4]])


def test_the_same_answer_is_verified() -> None:
    got = probe_agreement((IDS, LOGP), (IDS.clone(), LOGP.clone()), PROBE_TOLERANCE["fp32"])
    assert got == {"engine_probe_agreed": 1.0, "engine_probe_logp_diff_max": 0.0, "engine_verified": True}


def test_a_bf16_sized_gap_is_verified_in_bf16_only() -> None:
    after = (IDS, LOGP + 0.03)  # what bf16 engines of two tp degrees differ by
    assert probe_agreement((IDS, LOGP), after, PROBE_TOLERANCE["bf16"])["engine_verified"]
    assert not probe_agreement((IDS, LOGP), after, PROBE_TOLERANCE["fp32"])["engine_verified"]


def test_tokens_past_a_divergence_are_not_compared_and_a_different_first_token_fails() -> None:
    ids = IDS.clone()
    ids[0, 2] = 1  # row 0 chose another token at position 2: what follows is another text
    logp = LOGP.clone()
    logp[0, 2:] += 5.0
    got = probe_agreement((IDS, LOGP), (ids, logp), PROBE_TOLERANCE["fp32"])
    assert got["engine_verified"] and got["engine_probe_agreed"] == 6 / 8
    ids[1, 0] = 0  # row 1 disagrees from its first token: nothing to compare there
    assert not probe_agreement((IDS, LOGP), (ids, logp), PROBE_TOLERANCE["fp32"])["engine_verified"]
