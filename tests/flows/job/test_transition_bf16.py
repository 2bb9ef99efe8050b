"""A transition of a bf16 job (``model.dtype: bf16``) moves every model's state bit for bit, the
fp32 master weights of the train stages among it, and training goes on."""

from __future__ import annotations

import copy

import pytest
import torch

from nereus_core.config import parse_config
from storage.journal import Journal
from tests.support.transition_checks import assert_same_state, train_then_move_to_plan_b

from .test_ppo_job import SMALL

pytestmark = pytest.mark.usefixtures("prefect_server")  # the flows run against the suite's one Prefect server

BF16 = copy.deepcopy(SMALL)
BF16["model"]["dtype"] = "bf16"
# The actor's log-probs after the move come from another layout (tp, pp and dp all change), so
# bf16 activations are summed in another order: they agree to bf16's precision, not bitwise
# (observed: 2.2e-3 on log-probs of magnitude up to 3.7, about bf16's relative step 2**-9 = 2e-3).
LOGP_TOLERANCE = 1e-2


def test_a_bf16_transition_moves_weights_and_masters_bitwise(tmp_path) -> None:
    moved = train_then_move_to_plan_b(parse_config(BF16), tmp_path, "t-bf16")
    assert Journal(tmp_path, "t-bf16").status() == "committed"
    assert moved.stats["bytes_moved"] > 0
    assert_same_state(moved.before, moved.after, "the transition")
    actor = moved.before["actor/train"]
    masters = [n for n in actor if n.endswith(":master")]
    assert masters and all(actor[n].dtype is torch.float32 for n in masters)
    assert any(not torch.equal(actor[n], actor[n.removesuffix(":master")].float()) for n in masters)
    assert all(t.dtype is torch.bfloat16 for n, t in actor.items() if ":" not in n)
    assert (moved.logp_before - moved.logp_after).abs().max().item() <= LOGP_TOLERANCE
    # the synced generation copy
    assert (moved.logp_gen - moved.logp_after).abs().max().item() <= LOGP_TOLERANCE
    assert torch.isfinite(torch.tensor(moved.loss_after))
