"""Self-attention over packed sequences (no padding), tensor parallel over heads.

A micro batch is `T` tokens of `N` sequences laid end to end; `cu_seqlens [N+1]` marks the boundaries and every
token attends causally to earlier tokens of its own sequence only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardrl.models.config import ModelConfig
from shardrl.errors import UserError
from shardrl.models.fast_paths import AttentionKernel, FastPaths
from shardrl.models.norm import RMSNorm
from shardrl.models.rope import rotate
from shardrl.parallel.context import ContextShard, context_attention_mask, gather_tokens
from shardrl.parallel.layout import Layout
from shardrl.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from shardrl.parallel.tensor_overlap import column_parallel, row_parallel


class KVCacheHook(Protocol):
    """Inference-only replacement for `packed_attention` (the rollout engine's KV cache, `shardrl.rollout`): it
    stores this layer's k and v and returns the attention output."""

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, seqs: PackedSeqs, scale: float) -> Tensor: ...


@dataclass(frozen=True)
class PackedSeqs:
    """What every layer needs to know about the packed micro batch; built once per forward."""

    cu_seqlens: Tensor  # [N+1] int32: sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    max_seqlen: int
    cos: Tensor  # [T, head_dim] fp32 rotary angles of each token's position
    signed_sin: Tensor  # [T, head_dim] fp32, first half negated (`rope.RotaryEmbedding`)
    kv_cache: KVCacheHook | None = None  # set only by the rollout engine
    context: ContextShard | None = None  # context parallel: the tokens are this CP rank's share of the micro batch

    @property
    def num_tokens(self) -> int:
        """This rank's tokens (a CP share's with context parallelism)."""
        return self.cos.shape[0]

    @functools.cached_property
    def context_mask(self) -> Tensor:
        """[T_r, T] which of the micro batch's keys each of this CP rank's queries sees: built once per forward."""
        return context_attention_mask(self.cu_seqlens, self.context.local_index)

    @functools.cached_property
    def query_spans(self) -> tuple[Tensor, Tensor, Tensor]:
        """Each sequence's first token, token count and first position ([N] int32 each): the batch-invariant
        attention's description of a packed micro batch, built once per forward for all layers."""
        starts = self.cu_seqlens[:-1]
        return starts, self.cu_seqlens[1:] - starts, torch.zeros_like(starts)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, seqs: PackedSeqs, scale: float, bitwise: bool = False,
                     kernel: Literal["flash", "fa4"] = "flash") -> Tensor:
    """q [T, nq, D], k and v [T, nkv, D] (nq a multiple of nkv) -> [T, nq, D].

    The one device-specific switch: CUDA in bf16/fp16 runs a fused varlen kernel, flash attention's
    (`_FlashVarlen`) or FlashAttention-4's (`kernel`, resolved by `resolve_attention_kernel`), or with `bitwise`
    the batch-invariant kernel (`_BitwiseAttention`); everything else runs `reference_attention`, which the tests
    compare against.
    """
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        if bitwise:
            return _BitwiseAttention.apply(q, k, v, seqs, scale)
        return _varlen(kernel, q, k, v, seqs.cu_seqlens, seqs.cu_seqlens, seqs.max_seqlen, seqs.max_seqlen, scale)
    return reference_attention(q, k, v, seqs.cu_seqlens, scale)


class AttentionKernelError(UserError, RuntimeError):
    """The attention kernel a config names cannot run here (one line: what and what to do)."""


# Head sizes whose FA4 forward and backward matched torch's flash attention on an H200 (flash-attn-4 4.0.0b40): at
# head_dim 16, 48 and 80 its backward returned wrong gradients (cosine 0.06-0.22 to torch's), so sizes are allowed
# one by one, and only on Hopper, where they were checked.
FA4_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def fa4_unavailable(device: torch.device, head_dim: int) -> str | None:
    """Why FlashAttention-4 cannot run this model's attention on `device`, or None when it can: only where its
    gradients were checked against torch's flash attention (Hopper, `FA4_HEAD_DIMS`)."""
    if device.type != "cuda":
        return "FlashAttention-4 runs on CUDA GPUs only"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"FlashAttention-4 is used on Hopper GPUs (compute capability 9.x, where it was checked), not "
                f"{major}.{minor}")
    if head_dim not in FA4_HEAD_DIMS:
        return (f"FlashAttention-4 is used for head_dim in {FA4_HEAD_DIMS} (checked against torch's flash attention), "
                f"not {head_dim}")
    return _fa4_import_error()


@functools.cache
def _fa4_import_error() -> str | None:
    try:
        import flash_attn.cute.interface  # noqa: F401  (imported once, where the kernels are wanted)
    except Exception as error:  # an optional package's import can fail past ImportError (its CUDA libraries)
        return f"the flash-attn-4 package cannot be imported ({error}); pip install 'shardrl[fa4]'"
    return None


def resolve_attention_kernel(kernel: AttentionKernel, device: torch.device, head_dim: int
                             ) -> Literal["flash", "fa4"]:
    """The kernel a model's attention runs: `auto` is FA4 where it runs, else torch's flash; an explicit `fa4` that
    cannot run here raises AttentionKernelError saying why (the config's key is checked before launch too)."""
    if kernel == "flash":
        return "flash"
    reason = fa4_unavailable(device, head_dim)
    if reason is None:
        return "fa4"
    if kernel == "fa4":
        raise AttentionKernelError(f"attention_backend=fa4: {reason}; set flash or auto")
    return "flash"


def _varlen(kernel: Literal["flash", "fa4"], q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor,
            max_q: int, max_k: int, scale: float) -> Tensor:
    """Causal attention of queries cu_q[i]:cu_q[i+1] against keys cu_k[i]:cu_k[i+1], aligned at the bottom right,
    by the chosen fused kernel (each has its own backward)."""
    if kernel == "fa4":
        from flash_attn.cute.interface import flash_attn_varlen_func

        out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                        max_seqlen_k=max_k, softmax_scale=scale, causal=True)
        return out
    return _FlashVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale)


def context_attention(q: Tensor, k: Tensor, v: Tensor, seqs: PackedSeqs, scale: float,
                      kernel: Literal["flash", "fa4"] = "flash") -> Tensor:
    """Context parallel: this CP rank's queries q [T_r, nq, D] against the whole micro batch's keys and values,
    all-gathered over CP from every rank's k, v [T_r, nkv, D] (`parallel/context.py`) -> [T_r, nq, D]."""
    keys = gather_tokens(k, seqs.context, replicated=False)  # [T, nkv, D]
    values = gather_tokens(v, seqs.context, replicated=False)
    return shard_attention(q, keys, values, seqs, scale, kernel)


def shard_attention(q: Tensor, keys: Tensor, values: Tensor, seqs: PackedSeqs, scale: float,
                    kernel: Literal["flash", "fa4"] = "flash") -> Tensor:
    """Causal attention of a CP share's queries q [T_r, nq, D] over the whole micro batch's keys and values [T, nkv,
    D]. CUDA in bf16/fp16: the fused varlen kernel, each held chunk's queries against its sequence's key prefix
    (causal from the bottom right, as a query chunk at the end of its keys needs); elsewhere SDPA with the [T_r, T]
    mask of the queries' positions, the reference the GPU test compares against."""
    shard = seqs.context
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        if shard.max_q == 0:  # this rank holds no token of the micro batch
            return q.new_zeros(q.shape)
        return _varlen(kernel, q, keys[shard.key_index], values[shard.key_index], shard.cu_q, shard.cu_k,
                       shard.max_q, shard.max_k, scale)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=seqs.context_mask, scale=scale, enable_gqa=True)  # [nq, T_r, D]
    return out.transpose(0, 1)


def bitwise_attention(q: Tensor, keys: Tensor, values: Tensor, q_start: Tensor, q_len: Tensor, q_pos: Tensor,
                      k_start: Tensor, max_q_len: int, scale: float, lse: Tensor | None = None) -> Tensor:
    """The batch-invariant attention kernel (`bitwise_kernels.attention`: packed queries against key stores, the
    training batch's own k and v or the engine's cache) for every caller in bitwise mode, so a query's bits do not
    depend on whether it is decoded, prefilled or trained."""
    from shardrl.parallel.bitwise_kernels import attention  # Triton: CUDA installs only

    return attention(q, keys, values, q_start, q_len, q_pos, k_start, max_q_len, scale, lse)


class _FlashVarlen(torch.autograd.Function):
    """Causal flash attention over packed sequences, with the KV heads as they are: the kernels map each query head
    to its KV head and sum dk/dv over the group themselves. torch's public `varlen_attn` takes grouped heads only
    from 2.13 on, and repeating them first cost a copy of k and v per layer, its saved memory and a group sum in
    backward: 1.15-1.25x slower forward, 1.04-1.06x forward + backward (`bench/attention_kernels.py`, one H200)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                scale: float) -> Tensor:
        """Queries cu_q[i]:cu_q[i+1] against keys cu_k[i]:cu_k[i+1] (the same boundaries outside context
        parallelism), causal from the bottom right."""
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, unused)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, cu_q, cu_k, rng_state, unused = ctx.saved_tensors
        return *_flash_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, rng_state, unused, ctx.max_q, ctx.max_k,
                                ctx.scale), None, None, None, None, None


def _flash_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                    cu_k: Tensor, rng_state: Tensor, unused: Tensor, max_q: int, max_k: int, scale: float
                    ) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, rng_state, unused,
        scale=scale)


class _BitwiseAttention(torch.autograd.Function):
    """Forward: the batch-invariant kernel over the packed sequences (`bitwise_attention`), which also stores each
    row's log-sum-exp in flash attention's layout. Backward: flash attention's, from that output and log-sum-exp
    (a gradient of the same function up to rounding; backward bits need not match the rollout's)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, seqs: PackedSeqs, scale: float) -> Tensor:
        starts, lengths, first_positions = seqs.query_spans
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)  # [nq, T], as flash's varlen forward's
        out = bitwise_attention(q, k, v, starts, lengths, first_positions, starts, seqs.max_seqlen, scale, lse)
        ctx.save_for_backward(q, k, v, out, lse, seqs.cu_seqlens)
        ctx.max_seqlen, ctx.scale = seqs.max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        no_dropout_rng = torch.empty((), dtype=torch.int64)  # what flash's forward returns without dropout
        return *_flash_backward(grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, no_dropout_rng, no_dropout_rng,
                                ctx.max_seqlen, ctx.max_seqlen, ctx.scale), None, None


def reference_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """Portable attention: SDPA over all T tokens with a block-diagonal causal mask [T, T]."""
    num_tokens = q.shape[0]
    index = torch.arange(num_tokens, device=q.device)
    segment = torch.searchsorted(cu_seqlens[1:].to(index.dtype), index, right=True)  # [T] sequence of each token
    mask = (segment.unsqueeze(1) == segment.unsqueeze(0)) & (index.unsqueeze(0) <= index.unsqueeze(1))  # [T, T]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=scale, enable_gqa=True)  # [nq, T, D]
    return out.transpose(0, 1)


class Attention(nn.Module):
    """q/k/v column-parallel over heads, o row-parallel. KV heads fewer than TP are replicated: consecutive ranks
    share a KV head, which lines up with the query heads they hold."""

    def __init__(self, config: ModelConfig, layout: Layout, layer_id: int, sequence_parallel: bool,
                 dtype: torch.dtype, fast: FastPaths = FastPaths()) -> None:
        super().__init__()
        self.fast = fast
        tp, prefix = layout.tp_size, f"model.layers.{layer_id}.self_attn"
        hidden, head_dim = config.hidden_size, config.head_dim
        num_heads, num_kv = config.num_heads, config.num_kv_heads
        if num_heads % tp or (num_kv % tp and tp % num_kv):
            raise ValueError(f"num_attention_heads={num_heads}, num_key_value_heads={num_kv}: tensor parallel size "
                             f"{tp} must divide the query heads and divide or be a multiple of the KV heads")
        self.group, self.sequence_parallel, self.layer_id = layout.tp_group, sequence_parallel, layer_id
        self.head_dim, self.scale = head_dim, head_dim ** -0.5
        kv_shards, bitwise = min(num_kv, tp), fast.bitwise
        self.kernel = resolve_attention_kernel(fast.attention, layout.device, head_dim)
        self.q_proj = ColumnParallelLinear(hidden, num_heads * head_dim, layout, f"{prefix}.q_proj",
                                           config.qkv_bias, dtype=dtype, bitwise=bitwise)
        self.k_proj = ColumnParallelLinear(hidden, num_kv * head_dim, layout, f"{prefix}.k_proj", config.qkv_bias,
                                           num_shards=kv_shards, dtype=dtype, bitwise=bitwise)
        self.v_proj = ColumnParallelLinear(hidden, num_kv * head_dim, layout, f"{prefix}.v_proj", config.qkv_bias,
                                           num_shards=kv_shards, dtype=dtype, bitwise=bitwise)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, layout, f"{prefix}.o_proj", config.o_bias,
                                        sequence_parallel, dtype=dtype, bitwise=bitwise)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # each rank normalises only its own heads, so the weights' gradients are summed over TP
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, f"{prefix}.q_norm.weight", tp > 1,
                                  layout.device, dtype, fast.compile, bitwise)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, f"{prefix}.k_norm.weight", tp > 1,
                                  layout.device, dtype, fast.compile, bitwise)

    @property
    def column_linears(self) -> tuple[ColumnParallelLinear, ...]:
        """The linears that read the layer's input, in output order (an inference engine packs them: one GEMM)."""
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: Tensor, seqs: PackedSeqs, residual: Tensor | None = None) -> Tensor:
        """x [T, H] (or this rank's SP chunk [T_r, H]) -> same shape, plus `residual` where given (the output
        projection adds it)."""
        q, k, v = column_parallel(x, self.column_linears, self.group, self.sequence_parallel, seqs.num_tokens,
                                  self.fast.tp_overlap.backward)
        q = q.unflatten(-1, (-1, self.head_dim))  # [T, nq/tp, D]
        k = k.unflatten(-1, (-1, self.head_dim))  # [T, nkv/tp or 1, D]
        v = v.unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, k, seqs.cos, seqs.signed_sin, self.fast.compile)
        if seqs.context is not None:
            out = context_attention(q, k, v, seqs, self.scale, self.kernel)  # [T_r, nq/tp, D]
        elif seqs.kv_cache is None:
            out = packed_attention(q, k, v, seqs, self.scale, self.fast.bitwise, self.kernel)  # [T, nq/tp, D]
        else:
            out = seqs.kv_cache.attend(self.layer_id, q, k, v, seqs, self.scale)
        return row_parallel(out.flatten(1), self.o_proj, self.fast.tp_overlap.chunks, residual)
