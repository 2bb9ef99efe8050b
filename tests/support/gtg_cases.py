"""The GTG tests' models, load helpers and hypothesis strategy of random plan pairs and capacities."""

from __future__ import annotations

import math
from collections import defaultdict
from functools import cache

from hypothesis import strategies as st

from nereus_core.config import ModelConfig
from nereus_core.emu import bytes_per_device
from nereus_core.layout import Layout
from tests.support.model_configs import SHARDABLE

LM = SHARDABLE
VALUE = LM.model_copy(update={"head": "value"})
MODELS = {
    "actor/train": (LM, True),
    "critic/infer": (VALUE, False),
    "reference/infer": (LM, False),
    "reward/infer": (VALUE, False),
}


@cache
def shard(config: ModelConfig, train: bool, layout: Layout) -> dict[int, int]:
    return {d: sum(k.values()) for d, k in bytes_per_device(config, layout, train=train).items()}


def loads(plan: dict[str, Layout], models: dict[str, tuple[ModelConfig, bool]]) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for s, layout in plan.items():
        for d, b in shard(*models[s], layout).items():
            out[d] += b
    return dict(out)


@st.composite
def layouts(draw: st.DrawFn, n: int) -> Layout:
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if t <= n]))
    pp = draw(st.sampled_from([p for p in (1, 2) if tp * p <= n]))
    dp = draw(st.integers(1, max(1, min(4, n // (tp * pp)))))
    devices = draw(st.permutations(range(n)))[: tp * pp * dp]
    return Layout(tp=tp, pp=pp, dp=dp, devices=tuple(devices))


@st.composite
def transitions(draw: st.DrawFn, max_devices: int = 16, max_stages: int = 3) -> tuple:
    n = draw(st.integers(2, max_devices))
    stages = draw(st.lists(st.sampled_from(sorted(MODELS)), min_size=2, max_size=max_stages, unique=True))
    models = {s: MODELS[s] for s in stages}
    plan_a = {s: draw(layouts(n)) for s in stages}
    plan_b = {s: plan_a[s] if draw(st.integers(0, 4)) == 0 else draw(layouts(n)) for s in stages}
    before, after = loads(plan_a, models), loads(plan_b, models)
    # Per device from "plan A and plan B each just fit" (slack 0) to "both at once" (slack 1).
    slack = draw(st.sampled_from([0.0, 0.0, 0.1, 0.3, 0.6, 1.0]))
    caps = {}
    for d in range(n):
        a, b = before.get(d, 0), after.get(d, 0)
        caps[d] = max(a, b) + math.floor(slack * min(a, b))
    return plan_a, plan_b, models, caps, slack


SWAP_MODELS = {"reference/infer": (LM, False), "reward/infer": (VALUE, False)}
ON0, ON1 = Layout.contiguous(first=0), Layout.contiguous(first=1)
SWAP_A = {"reference/infer": ON0, "reward/infer": ON1}
SWAP_B = {"reference/infer": ON1, "reward/infer": ON0}
REF = sum(shard(LM, False, ON0).values())  # the lm head makes it bigger than
REW = sum(shard(VALUE, False, ON0).values())  # the value-head model
