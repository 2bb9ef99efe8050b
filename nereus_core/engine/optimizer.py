"""The optimizer of a train model-stage: AdamW under DeepSpeed ZeRO over the layout's DP group.

Boundary: this module turns a built pipeline stage and its layout's groups into a
DeepSpeed engine (``make_engine``); it knows nothing about forward passes, losses or
pipeline schedules (``engine.train`` drives the engine it returns). The layout's TP
group reaches DeepSpeed as ``mpu``, the interface DeepSpeed asks of Megatron.

Gradient clipping (``grad_clip``, DeepSpeed's ``gradient_clipping``) scales the step's
gradients by ``min(1, grad_clip / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``,
with ``norm`` the global norm over the whole model: DeepSpeed sums squared norms over the
DP group and over the mpu's model-parallel group, which ``LayoutMpu`` answers with the
replica's tp x pp devices, so every pipeline stage clips by the same norm. It is off (0)
unless asked for; the job asks for ``ppo.grad_clip``.

Mixed precision (``model.dtype: bf16``) is DeepSpeed's bf16 mode under ZeRO-1/2
(``deepspeed/runtime/zero/stage_1_and_2.py``): the parameters and their gradients are
bf16, and each DP rank keeps its partition of the weights in fp32
(``single_partition_of_fp32_groups``, the master weights) with AdamW's moments beside
it; the step updates the fp32 partition and copies it, rounded, into the bf16
parameters. Each micro-batch's gradient is bf16; how they add up over micro-batches
depends on the ZeRO stage (DeepSpeed 0.19's ``grad_accum_dtype``):

- ZeRO-2: in fp32 (``grad_accum_dtype: fp32``). DeepSpeed adds each micro-batch's reduced
  bf16 gradient into an fp32 partition buffer, so the step sees the exact fp32 sum, not
  one rounded to bf16 after every micro-batch.
- ZeRO-1 (the job's stage): in bf16, in ``param.grad``. For ZeRO-1 DeepSpeed answers
  ``grad_accum_dtype: fp32`` with its ``BF16_Optimizer`` instead of the ZeRO optimizer,
  whose state layout (flat groups, masters) ``engine.state`` does not convert, so a
  transition or checkpoint could not carry it.

A layout sharded ``full`` (``Layout.shard``) runs ZeRO-3 instead, whatever ``zero_stage`` says: the
weights and gradients are partitioned over the DP group as well, every parameter of any size
(``stage3_param_persistence_threshold: 0``: a small one kept whole on every rank would be state
outside the EMU's shares), each module's weights gathered for its forward and again for its
backward. Its gradient bucket (in the model's dtype, allocated once and held) is the largest
module's parameters.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from nereus_core.emu import REDUCE_BUCKET_ELEMENTS, reduce_bucket_elements
from nereus_core.engine.device import RankGroups
from nereus_core.model.llama import LlamaStage


class OptimizerSettings(BaseModel):
    """AdamW under DeepSpeed ZeRO-1 over the DP group."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(default=1e-3, gt=0, description="Learning rate.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(default=0.0, ge=0, description="Decoupled weight decay.")
    zero_stage: int = Field(
        default=1,
        ge=0,
        le=2,
        description="DeepSpeed ZeRO stage over the DP group of layouts sharding the optimizer state "
        "(Layout.shard: optimizer); a layout sharded full runs ZeRO-3.",
    )
    grad_clip: float = Field(
        default=0.0,
        ge=0,
        description="Clip the global gradient norm to this before the step (DeepSpeed's gradient_clipping); "
        "0: no clipping.",
    )


class LayoutMpu:
    """The ``mpu`` interface DeepSpeed asks of Megatron, answered from a layout's groups.

    As Megatron's, the model-parallel group is the replica's tp x pp devices (one dp index), and
    the tensor-model-parallel group its tp devices: DeepSpeed sums the squared gradient norm over
    the model-parallel group, so pipeline stages (disjoint layers) add up. The model-parallel rank
    is the tp rank, the convention DeepSpeed's norms read it by (``bwc_tensor_model_parallel_rank``
    and ``clip_grad_norm_`` both count a tp-replicated weight only where it is 0), so a weight
    replicated over tp (a norm, the value head) counts once per pipeline stage.
    """

    def __init__(self, groups: RankGroups) -> None:
        self.groups = groups

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.groups.layout.dp

    def get_data_parallel_rank(self) -> int:
        return self.groups.coord.dp

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.replica_group

    def get_model_parallel_world_size(self) -> int:
        return self.groups.layout.tp * self.groups.layout.pp

    def get_model_parallel_rank(self) -> int:
        return self.groups.coord.tp

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.groups.layout.tp

    def get_tensor_model_parallel_rank(self) -> int:
        return self.groups.coord.tp


def deepspeed_config(
    settings: OptimizerSettings,
    micro_batch: int,
    micro_batches: int,
    *,
    bf16: bool = False,
    params: int = REDUCE_BUCKET_ELEMENTS,
    full: bool = False,
) -> dict[str, Any]:
    """DeepSpeed's config of a train stage of ``params`` elements on this device (its gradient bucket:
    ``emu.reduce_bucket_elements``); ``full``: ZeRO-3 (``Layout.shard``)."""
    zero: dict[str, Any] = {"stage": 3 if full else settings.zero_stage}
    zero["reduce_bucket_size"] = reduce_bucket_elements(params)
    if full:
        # Every parameter partitioned, and at most the module at work and the next one gathered: the
        # defaults keep up to 1e9 gathered elements live (a small model stays gathered whole).
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_prefetch_bucket_size"] = zero["reduce_bucket_size"]
        zero["stage3_max_live_parameters"] = 2 * zero["reduce_bucket_size"]
        zero["stage3_max_reuse_distance"] = 0
    config: dict[str, Any] = {
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": micro_batches,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": settings.grad_clip,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16 and settings.zero_stage == 2 and not full:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def make_engine(stage: LlamaStage, groups: RankGroups, settings: OptimizerSettings, backend: str) -> Any:
    """Wrap ``stage`` in a DeepSpeed engine with AdamW; called on every device of the layout."""
    bf16 = stage.config.dtype == "bf16"
    full = groups.layout.shard == "full"
    if bf16 and settings.zero_stage == 0 and not full:
        # Without ZeRO DeepSpeed trains bf16 through its fp16 optimizer, with dynamic loss scaling.
        raise ValueError("model.dtype=bf16 needs zero_stage 1 or 2 (stage 0 would scale the loss)")
    # Imported here, not at the top: importing DeepSpeed costs seconds, and only train stages need it.
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    _without_shm_all_reduce()
    _without_world_trace_check()
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    optimizer = torch.optim.AdamW(
        stage.parameters(),
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )
    # The micro-batch size is only bookkeeping for DeepSpeed; batches are sized by the caller.
    config = deepspeed_config(
        settings,
        micro_batch=1,
        micro_batches=groups.layout.micro_batches,
        bf16=bf16,
        params=_largest_module(stage) if full else sum(p.numel() for p in stage.parameters()),
        full=full,
    )
    with _barriers_within(groups.dp_group if full else None):
        engine, *_ = deepspeed.initialize(
            model=stage, optimizer=optimizer, config=config, mpu=LayoutMpu(groups)
        )
    return engine


@contextlib.contextmanager
def _barriers_within(within: dist.ProcessGroup | None) -> Iterator[None]:
    """Make DeepSpeed's barriers without a group wait on ``group`` only (None: leave them be).

    ZeRO-3's optimizer waits on the default group while it builds its partitions
    (``stage3.py``: ``dist.barrier()``): every device of the pool, where the devices outside this
    layout run other model-stages or nothing and never join. The layout's DP group is every rank
    that shares the partitions, all the barrier orders.
    """
    if within is None:
        yield
        return
    comm = importlib.import_module("deepspeed.comm")
    world_barrier = comm.barrier

    def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **kwargs: Any) -> Any:
        group = within if group is None else group
        return world_barrier(group=group, async_op=async_op, device_ids=device_ids)

    comm.barrier = barrier
    try:
        yield
    finally:
        comm.barrier = world_barrier


def _largest_module(stage: LlamaStage) -> int:
    """Elements of the stage's largest module's own parameters: what ZeRO-3 reduces at once (it
    gathers and reduces module by module), so its gradient bucket, allocated whole at the start and
    held, needs no more."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in stage.modules())


def _without_shm_all_reduce() -> None:
    """Keep DeepSpeed's CPU backend from JIT-compiling its shared-memory all-reduce op.

    On CPU, DeepSpeed's communication backend compiles that C++ op the first time a process
    starts it, under a lock file in the torch extensions cache: on a fresh machine every worker
    waits on the compiler, and a build killed half-way leaves the lock behind, so every later
    start waits on it for ever. The op serves only DeepSpeed's inference all-reduce; Nereus's
    collectives run on torch.distributed's own backends, so the backend is built without it.
    """
    # By module path: ``deepspeed.comm.torch`` as an attribute is the torch package itself.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _without_world_trace_check() -> None:
    """Keep ZeRO-3 from comparing its module trace across the whole world.

    After a step's first forward and backward ZeRO-3 checks that every rank recorded the same
    modules in the same order (``partitioned_param_coordinator.reset_step`` ->
    ``assert_ints_same_as_other_ranks``), by broadcasts over the default group: every device of
    the pool, where Nereus runs other model-stages (or none) on the devices outside this layout,
    which never join, so the step waits for ever. The check is a consistency assertion only; the
    layout's own ranks run one module in one order by construction.
    """
    module = importlib.import_module("deepspeed.runtime.zero.partitioned_param_coordinator")
    module.assert_ints_same_as_other_ranks = lambda ints: None
