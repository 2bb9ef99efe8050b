"""A transition of a bf16 job (``model.dtype: bf16``) moves every model's state bit for bit, the
fp32 master weights of the train stages among it, and training goes on."""

from __future__ import annotations

import copy

import torch
from prefect.testing.utilities import prefect_test_harness

from flows.transition import transition_flow
from nereus_core import job as jb
from nereus_core.config import parse_config
from nereus_core.engine.train import lm_loss, score_mse_loss
from nereus_core.model.weights import init_full_state
from nereus_core.plan import PPO_STAGES, own_state
from storage.journal import Journal
from tasks import job_ops, model_ops
from tasks.device_pool import DevicePool

from .test_ppo_job import SMALL
from .test_transition import PLAN_B, _state

BF16 = copy.deepcopy(SMALL)
BF16["model"]["dtype"] = "bf16"
# The actor's log-probs after the move come from another layout (tp, pp and dp all change), so
# bf16 activations are summed in another order: they agree to bf16's precision, not bitwise
# (observed: 2.2e-3 on log-probs of magnitude up to 3.7, about bf16's relative step 2**-9 = 2e-3).
LOGP_TOLERANCE = 1e-2


def test_a_bf16_transition_moves_weights_and_masters_bitwise(tmp_path) -> None:
    cfg = parse_config(BF16)
    ids = torch.randint(1, 11, (8, 8), generator=torch.Generator().manual_seed(3))
    batch_critic = {"ids": ids, "score": torch.linspace(0, 1, 8)}
    with prefect_test_harness(server_startup_timeout=300), DevicePool(4) as pool:
        state = jb.start(cfg)
        reward = init_full_state(jb.model_config(cfg, "reward/infer"))
        job_ops.load_models(pool, cfg, state.layouts, state.aliased, reward)
        plan_a = dict(state.layouts)
        model_ops.train(pool, plan_a["actor/train"], {"ids": ids}, name="actor/train", loss_fn=lm_loss)
        model_ops.train(
            pool, plan_a["critic/train"], batch_critic, name="critic/train", loss_fn=score_mse_loss
        )
        before = _state(pool, cfg, plan_a)
        logp_before = model_ops.forward(pool, plan_a["actor/train"], ids, name="actor/train")
        stats = transition_flow(pool, cfg, str(tmp_path), "t-bf16", plan_a, PLAN_B, step=1, reason="test")
        after = _state(pool, cfg, PLAN_B)
        logp_after = model_ops.forward(pool, PLAN_B["actor/train"], ids, name="actor/train")
        logp_gen = model_ops.forward(pool, PLAN_B["actor/generate"], ids, name="actor/generate")
        loss_after = model_ops.train(
            pool, PLAN_B["actor/train"], {"ids": ids}, name="actor/train", loss_fn=lm_loss
        )
    assert Journal(tmp_path, "t-bf16").status() == "committed"
    assert stats["bytes_moved"] > 0
    for stage in own_state(PPO_STAGES):
        assert before[stage].keys() == after[stage].keys(), stage
        for name, tensor in before[stage].items():
            same = tensor.dtype == after[stage][name].dtype and torch.equal(tensor, after[stage][name])
            assert same, f"{stage} {name} changed in the transition"
    actor = before["actor/train"]
    masters = [n for n in actor if n.endswith(":master")]
    assert masters and all(actor[n].dtype is torch.float32 for n in masters)
    assert any(not torch.equal(actor[n], actor[n.removesuffix(":master")].float()) for n in masters)
    assert all(t.dtype is torch.bfloat16 for n, t in actor.items() if ":" not in n)
    assert (logp_before - logp_after).abs().max().item() <= LOGP_TOLERANCE
    assert (logp_gen - logp_after).abs().max().item() <= LOGP_TOLERANCE  # the synced generation copy
    assert torch.isfinite(torch.tensor(loss_after))
