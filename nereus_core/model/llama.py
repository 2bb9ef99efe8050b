"""A Llama pipeline stage; it knows nothing of pipeline communication or data parallelism (the engine's job).

Architecture as Hugging Face ``LlamaForCausalLM`` (Touvron et al., 2023,
arXiv:2302.13971) or ``Qwen2ForCausalLM`` (the same decoder with q/k/v biases;
Qwen2 report, arXiv:2407.10671), with the same parameter names so full states round-trip:
pre-norm RMSNorm (Zhang & Sennrich, 2019; variance in fp32, then
``weight * normed``), rotary position embeddings (Su et al., 2021,
arXiv:2104.09864; HF's rotate-half layout, ``inv_freq = 1/theta^(2i/d)``, with
Llama 3's frequency scaling when configured, as HF's ``_compute_llama3_parameters``),
grouped-query attention (Ainslie et al., 2023, arXiv:2305.13245) and a SwiGLU
MLP (Shazeer, 2020, arXiv:2002.05202). Tensor parallelism splits heads and the
MLP's inner width (see ``tensor_parallel``); a rank holds ``H/tp`` query heads
and ``K/tp`` kv heads.

Positions drive RoPE only. A ``KVCache`` appends each forward's chunk at its
own length (``cache.length``), whatever the positions say, so left-padded rows
may carry their own positions; ``attention_mask`` (1 keep, 0 pad) hides pads.

A packed row (``engine.packing``: several sequences' real tokens concatenated, ``[1, T]``)
passes ``segments`` (flash-attn's ``cu_seqlens``): attention is causal within each sequence
and never across, without a dense ``[T, T]`` mask: flash-attn's ``flash_attn_varlen_func`` on
CUDA in bf16/fp16 when it is installed (as verl's ``use_remove_padding``), else one causal
``scaled_dot_product_attention`` per run of consecutive sequences of one length, the run batched as
a view of the row (measured on CPU against one call with a block-diagonal mask, SDPA on jagged
nested tensors and FlexAttention).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nereus_core.config import ModelConfig, RopeScaling
from nereus_core.model.tensor_parallel import (
    ColumnParallelLinear,
    Group,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    group_size,
)
from nereus_core.model.weights import param_dtype, shard_tensor, stage_param_names


class KVCache:
    """Preallocated keys and values ``[b, kv_heads_local, max_len, head_dim]`` per held layer."""

    def __init__(
        self,
        *,
        layers: range,
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.batch = batch
        self.max_len = max_len
        self.length = 0

    def append(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``layer``'s chunk at ``length`` and return all keys/values so far (views)."""
        end = self.length + k_new.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens > max_len={self.max_len}")
        self.k[layer][:, :, self.length : end] = k_new
        self.v[layer][:, :, self.length : end] = v_new
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, tokens: int) -> None:
        """Move ``length`` past a chunk every layer has appended."""
        self.length += tokens

    def reset(self) -> None:
        self.length = 0


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(
    *, head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The ``d/2`` fp32 inverse frequencies; Llama 3 divides long wavelengths by ``factor`` and
    interpolates smoothly between ``original/high_freq_factor`` and ``original/low_freq_factor``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    original = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = original / scaling.low_freq_factor, original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor,
    *,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[b or 1, 1, s, d]`` for absolute ``positions`` ``[b, s]`` or ``[s]``, computed in fp32.

    The frequencies are rebuilt per call (d/2 numbers) rather than kept as a buffer,
    so casting the stage to bf16 cannot round them.
    """
    inv_freq = rope_inv_freq(head_dim=head_dim, theta=theta, scaling=scaling, device=positions.device)
    positions_bs = positions if positions.dim() == 2 else positions.unsqueeze(0)
    freqs = positions_bs.unsqueeze(-1).float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def attention_mask_bool(
    *, queries: int, past: int, attention_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean ``[b or 1, 1, s, past+s]`` (True attends): causal within the chunk, all of the past.

    None when plain causal attention without a past suffices. Each query may always
    see its own key, so a fully padded row stays finite (its output is ignored).
    """
    if attention_mask is None and past == 0:
        return None
    total = past + queries
    key_pos = torch.arange(total, device=device)
    query_pos = torch.arange(past, total, device=device).unsqueeze(-1)
    allowed = (key_pos <= query_pos).unsqueeze(0)
    if attention_mask is not None:
        if attention_mask.shape[-1] != total:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[-1]} tokens; expected past+new={total}"
            )
        allowed = allowed & attention_mask.bool().unsqueeze(1)
        allowed = allowed | (key_pos == query_pos).unsqueeze(0)
    return allowed.unsqueeze(1)


@dataclass(frozen=True)
class Segments:
    """Packed sequences: sequence i is tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` of the row.

    ``runs`` groups consecutive sequences of one length: ``(start, count, length)``, so a run is a
    contiguous slice of the row that reshapes to ``[count, length]`` without a copy."""

    cu_seqlens: torch.Tensor  # int32 [n+1], on the row's device (flash-attn's)
    bounds: tuple[int, ...]  # the same, on the host
    runs: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, device: torch.device) -> Segments:
        bounds = tuple(cu_seqlens.tolist())
        runs: list[list[int]] = []
        for a, b in itertools.pairwise(bounds):
            if b == a:
                continue
            if runs and runs[-1][2] == b - a and runs[-1][0] + runs[-1][1] * runs[-1][2] == a:
                runs[-1][1] += 1
            else:
                runs.append([a, 1, b - a])
        return cls(cu_seqlens.to(device=device, dtype=torch.int32), bounds, tuple(map(tuple, runs)))

    @property
    def longest(self) -> int:
        return max((length for _, _, length in self.runs), default=0)


_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Causal attention within each packed sequence: q ``[1, H, T, d]``, k/v ``[1, K, T, d]``."""
    if _FLASH_ATTN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from flash_attn import flash_attn_varlen_func

        cu, longest = segments.cu_seqlens, segments.longest
        out = flash_attn_varlen_func(
            *(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu, longest, longest, causal=True
        )
        return out.transpose(0, 1).unsqueeze(0)
    if not segments.runs:
        return q.clone()
    # One causal SDPA per run of consecutive equal-length sequences: a view [count, H, length, d].
    outs = []
    for start, count, length in segments.runs:
        span = slice(start, start + count * length)
        q_r, k_r, v_r = (t[0][:, span].unflatten(1, (count, length)).transpose(0, 1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q_r, k_r, v_r, is_causal=True, enable_gqa=True)
        outs.append(out.transpose(0, 1).flatten(1, 2))
    return torch.cat(outs, dim=1).unsqueeze(0)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, *, tp_size: int, tp_group: Group) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
        tp = {"tp_size": tp_size, "tp_group": tp_group, "dtype": param_dtype(config)}
        qkv = {**tp, "copy_input": False, "bias": config.attention_bias}
        self.q_proj = ColumnParallelLinear(h, q_out, **qkv)
        self.k_proj = ColumnParallelLinear(h, kv_out, **qkv)
        self.v_proj = ColumnParallelLinear(h, kv_out, **qkv)
        self.o_proj = RowParallelLinear(q_out, h, **tp)
        self.tp_group = tp_group
        self.head_dim = d

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | Segments | None,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        x = copy_to_tp(x, self.tp_group)
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
        if cache is not None:
            k, v = cache.append(layer, k, v)
        if isinstance(mask, Segments):
            out = segment_attention(q, k, v, mask)
        else:
            # GQA: query head j reads kv head j // (H/K), as HF's repeat_kv, without copying the cache.
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and s > 1, enable_gqa=True
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, *, tp_size: int, tp_group: Group) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        tp = {"tp_size": tp_size, "tp_group": tp_group, "dtype": param_dtype(config)}
        self.gate_proj = ColumnParallelLinear(h, i, copy_input=False, **tp)
        self.up_proj = ColumnParallelLinear(h, i, copy_input=False, **tp)
        self.down_proj = RowParallelLinear(i, h, **tp)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp_group)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, *, tp_size: int, tp_group: Group) -> None:
        super().__init__()
        self.self_attn = Attention(config, tp_size=tp_size, tp_group=tp_group)
        self.mlp = MLP(config, tp_size=tp_size, tp_group=tp_group)
        norm = (config.hidden_size, config.rms_norm_eps, param_dtype(config))
        self.input_layernorm = RMSNorm(*norm)
        self.post_attention_layernorm = RMSNorm(*norm)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | Segments | None,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def _check_tp(config: ModelConfig, tp_rank: int, tp_size: int, tp_group: Group) -> None:
    problem = config.tp_error(tp_size)
    if problem:
        raise ValueError(problem)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is outside 0..{tp_size - 1}")
    if tp_group is not None and group_size(tp_group) != tp_size:
        raise ValueError(f"tp_size={tp_size} but tp_group has {group_size(tp_group)} ranks")
    # tp_rank may differ from the rank in tp_group (torch orders a group by world rank): the
    # vocab-parallel code takes the layout's tp coordinate explicitly, and the collectives it
    # uses (sums, and an all-gather resolved by value) do not depend on the group's order.


def _checked(name: str, shard: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if shard.shape != param.shape:
        raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != local shape {tuple(param.shape)}")
    return shard


class LlamaStage(nn.Module):
    """Decoder layers ``layers`` (with the embedding if first, norm and lm_head if last) on one tp rank.

    Parameters start as placeholders (zeros, norms 1.0): call ``load_full_state``
    (e.g. with ``init_full_state(config)``) before use. Without ``tp_group`` a stage
    with ``tp_size > 1`` has the local shapes but skips the collectives (for shapes
    and state handling only).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        layers: range,
        first: bool,
        last: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Group = None,
    ) -> None:
        super().__init__()
        _check_tp(config, tp_rank, tp_size, tp_group)
        self.config, self.layer_range, self.first, self.last = config, layers, first, last
        # Train passes recompute every decoder layer in backward (the model's launch flag, or the
        # layout's choice: ``engine.train.train_step`` sets it from ``Layout.recompute``).
        self.recompute = config.gradient_checkpointing
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.param_names = stage_param_names(config, layers, first, last)
        # Weights are allocated in model.dtype and left unwritten: the caller fills every one (a
        # reshard's receives, a checkpoint's slices, or seeded weights).
        tp, dtype = {"tp_size": tp_size, "tp_group": tp_group}, param_dtype(config)
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, tp_rank=tp_rank, dtype=dtype, **tp
            )
        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(config, **tp) for i in layers})
        if last:
            self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            if config.head == "value":
                # Replicated on every tp rank: one row, its gradient is the same on all of them.
                self.score = nn.Linear(config.hidden_size, 1, bias=False, dtype=dtype)
            else:
                self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, dtype=dtype, **tp)
                if config.tie_word_embeddings:
                    self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_heads_local(self) -> int:
        return self.config.num_key_value_heads // self.tp_size

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for this stage's layers, on its device and in its dtype."""
        weight = next(iter(self.model.layers.values())).self_attn.k_proj.weight
        return KVCache(
            layers=self.layer_range,
            batch=batch,
            max_len=max_len,
            kv_heads=self.kv_heads_local,
            head_dim=self.config.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    def _held(self) -> dict[str, nn.Parameter]:
        params = dict(self.named_parameters())
        return {name: params[name] for name in self.param_names}

    @torch.no_grad()
    def load_full_state(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of every held parameter from a full HF-named state."""
        missing = [name for name in self.param_names if name not in full]
        if missing:
            raise KeyError(f"full state lacks {len(missing)} parameters of this stage, e.g. {missing[0]!r}")
        for name, param in self._held().items():
            param.copy_(_checked(name, shard_tensor(full[name], name, self.tp_rank, self.tp_size), param))

    @torch.no_grad()
    def load_local_state(self, local: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shards, already cut (e.g. read as slices of a model directory), cast to
        the parameters' dtype."""
        missing = [name for name in self.param_names if name not in local]
        if missing:
            raise KeyError(f"local state lacks {len(missing)} parameters of this stage, e.g. {missing[0]!r}")
        for name, param in self._held().items():
            param.copy_(_checked(name, local[name], param))

    def local_state(self) -> dict[str, torch.Tensor]:
        """HF name -> this rank's shard (detached; shares memory with the parameter)."""
        return {name: param.detach() for name, param in self._held().items()}

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        segments: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Ids ``[b, s]`` (first) or hidden ``[b, s, h]`` -> hidden; on the last stage fp32 logits
        ``[b, s, V/tp]`` (lm head) or values ``[b, s]`` (value head).

        ``positions`` ``[b, s]`` or ``[s]`` are absolute (RoPE). With ``cache`` the chunk is
        appended and attends to everything cached before it; ``attention_mask``
        ``[b, past+s]`` marks real tokens (1) and pads (0) over the cache and the chunk.
        ``segments`` (``cu_seqlens``, a packed row ``[1, T]``) keeps attention within each
        sequence. ``last_only`` applies the last stage's head to the last position only
        (``[b, 1, ...]``): a sampler's prefill needs no logits for the rest of the prompt.
        """
        hidden = self.model.embed_tokens(x) if self.first else x
        s = hidden.shape[1]
        past = 0 if cache is None else cache.length
        cos_sin = rope_cos_sin(
            positions.to(hidden.device),
            head_dim=self.config.head_dim,
            theta=self.config.rope_theta,
            dtype=hidden.dtype,
            scaling=self.config.rope_scaling,
        )
        if segments is not None:
            if cache is not None or attention_mask is not None or hidden.shape[0] != 1:
                raise ValueError("segments take one packed row [1, T], without a cache or an attention_mask")
            mask = Segments.of(segments, hidden.device)
        else:
            mask = attention_mask_bool(
                queries=s, past=past, attention_mask=attention_mask, device=hidden.device
            )
        recompute = self.recompute and cache is None and torch.is_grad_enabled()
        for key, layer in self.model.layers.items():
            if recompute:  # keep the layer's input only; its activations are rebuilt in the backward
                hidden = checkpoint(layer, hidden, cos_sin, mask, None, int(key), use_reentrant=False)
            else:
                hidden = layer(hidden, cos_sin, mask, cache, int(key))
        if cache is not None:
            cache.advance(s)
        if not self.last:
            return hidden
        if last_only:
            hidden = hidden[:, -1:]
        if self.config.head == "value":
            return self.score(self.model.norm(hidden)).float().squeeze(-1)
        return self.lm_head(self.model.norm(hidden)).float()
