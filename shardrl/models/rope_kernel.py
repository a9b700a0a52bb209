"""Rotary position embedding as one Triton kernel on CUDA, for `rope.rotate`.

Why: written in torch ops, `apply_rope` is a roll, two broadcasting products and a sum (four passes over q and k,
the products on a non-vectorised broadcast path), and autograd replays as many backward; on one H200 this kernel
took a 1.2B model's training step from 0.645 to 0.618 s (`bench/train_mfu.py --world 1`, docs/benchmarks.md). Here
one program rotates one token's heads: it reads each element once, computes in fp32 from the fp32 angle tables, and
writes once.
The backward is the same kernel rotating by minus the angle (a rotation's transpose is its inverse).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ELEMENTS_PER_PROGRAM = 2048  # heads per program: as many as fill this many (head, channel pair) slots


@triton.jit
def _rotate_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, stride_x_token, stride_x_head, stride_o_token, stride_o_head,
                   stride_table, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   INVERSE: tl.constexpr):
    """Program (token, head block): channels i and i + HALF of each head turn by the token's angle i,
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), or by minus it when INVERSE."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_HALF)
    in_half = pairs < HALF
    mask = (heads < num_heads)[:, None] & in_half[None, :]
    cos = tl.load(cos_ptr + token * stride_table + pairs, mask=in_half, other=0.0).to(tl.float32)[None, :]
    # signed_sin's second half holds +sin (its first half the same values negated)
    sin = tl.load(sin_ptr + token * stride_table + HALF + pairs, mask=in_half, other=0.0).to(tl.float32)[None, :]
    if INVERSE:
        sin = -sin
    x_at = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head + pairs[None, :]
    x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + HALF, mask=mask, other=0.0).to(tl.float32)
    out_at = out_ptr + token * stride_o_token + heads[:, None] * stride_o_head + pairs[None, :]
    tl.store(out_at, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_at + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: Tensor, cos: Tensor, signed_sin: Tensor, inverse: bool) -> Tensor:
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if num_tokens and num_heads:
        half = head_dim // 2
        block_half = triton.next_power_of_2(half)
        block_h = min(triton.next_power_of_2(num_heads), max(1, ELEMENTS_PER_PROGRAM // block_half))
        _rotate_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            x, out, cos, signed_sin, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            num_heads, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, INVERSE=inverse, num_warps=4)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, signed_sin)
        return _launch(x, cos, signed_sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, signed_sin = ctx.saved_tensors
        return _launch(grad, cos, signed_sin, inverse=True), None, None


def rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x [T, heads, D] (any strides with unit channel stride), cos and signed_sin [T, D] fp32 as
    `RotaryEmbedding` makes them -> rotated [T, heads, D] in x's dtype (contiguous)."""
    if cos.stride(-1) != 1 or signed_sin.stride() != cos.stride():
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    return _Rotary.apply(x, cos, signed_sin)
