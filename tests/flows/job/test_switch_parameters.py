"""The transition subflow gets the controller's schedule ``quote``d, so Prefect does not walk it,
and sends no heartbeats of its own (the job's flow run does), so it does not wait for their thread.

Before a flow runs, Prefect walks its parameters for futures to resolve (``visit_collection``, to
any depth, into pydantic models). A move schedule holds the transition graph with every op of the
move: 55,938 for an 8B PPO switch on 16 GPUs, whose subflow call took 61.5 s bare and 1.2 s quoted
(benchmarks/bench_prefect_parameters.py). ``quote`` stops the walk; the flow still receives the
schedule itself. Here: the same shapes with 2 layers, to keep the test quick.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings
from prefect.utilities.annotations import quote
from prefect.utilities.collections import visit_collection
from prefect.utilities.engine import resolve_to_final_result

from flows.job import switch as switch_module
from nereus_core.config import LLAMA_3_8B
from nereus_core.controller.moves import MoveBasis
from nereus_core.controller.transition_schedule import schedule_moves
from nereus_core.layout import Layout
from nereus_core.plan import GlobalPlan, models_for

STAGES = ("actor/generate", "actor/train", "critic/train", "critic/infer", "reference/infer", "reward/infer")


def _walk(value: object) -> float:
    start = time.perf_counter()
    kw = {
        "return_data": True,
        "max_depth": -1,
        "remove_annotations": True,
        "context": {"parameter_name": "moves"},
    }
    visit_collection(value, visit_fn=resolve_to_final_result, **kw)  # as the flow engine resolves them
    return time.perf_counter() - start


def test_the_schedule_reaches_the_subflow_quoted(monkeypatch) -> None:
    devices = tuple(range(16))
    old = GlobalPlan.of({s: Layout(tp=8, dp=2, devices=devices) for s in STAGES})
    new = GlobalPlan.of({s: Layout(tp=4, dp=4, devices=devices) for s in STAGES})
    models = models_for(LLAMA_3_8B.model_copy(update={"num_hidden_layers": 2}))  # 8B's shapes, 2 layers
    moves = schedule_moves(old, new, models, MoveBasis(slots=16, memory_per_device=80 << 30))
    assert moves.planned is not None and len(moves.planned.graph.ops) > 1000
    seen = {}

    def transition_flow(*args, **kw):
        seen.update(kw, heartbeat=get_current_settings().flows.heartbeat_frequency)

    monkeypatch.setattr(switch_module, "transition_flow", transition_flow)
    ctx = SimpleNamespace(pool=None, records=SimpleNamespace(run=SimpleNamespace(root="run")))
    state = SimpleNamespace(config=None, plan=old)
    switch = SimpleNamespace(plan=new, reason="test", moves=moves, devices=8)
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):  # as `nereus` sets it
        switch_module._transition(ctx, state, switch, "t000", step=0, checkpoint_step=1)  # type: ignore[arg-type]
    assert isinstance(seen["moves"], quote) and seen["moves"].unquote() is moves
    # No heartbeat thread of its own: the flow run would wait up to a second for it to stop.
    assert seen["heartbeat"] is None
    # What the quote saves: the walk of the bare schedule against the quoted one's.
    assert _walk(seen["moves"]) < 0.01 < _walk(moves)
