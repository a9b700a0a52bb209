"""Fused vocab-block softmax statistics and logprob/entropy gradient on CUDA (Triton), for `parallel/vocab.py`.

Why kernels of our own: the portable maths walks [tokens, vocab] fp32 temporaries several times per micro batch
(a subtraction in mixed precision, an exp, a product, two sums forward; a subtraction, an exp, products, a scatter
and a cast backward). With a 128k vocabulary those passes took ~14% of a 1.2B model's training step on one H200
(`bench/train_mfu.py --world 1 --profile`, docs/benchmarks.md), several times the cost of reading the logits once.
Here the forward reads each logit once (an online softmax over 4096-column tiles per token row) and the backward
reads each logit once and writes its gradient once; all arithmetic is fp32 whatever the logits' dtype.

`vocab.py` keeps the portable version as the reference the tests compare against, and calls these only for CUDA
tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096  # vocab columns per tile (bf16: 8 KiB per row tile)
NUM_WARPS = 8


@triton.jit
def _stats_kernel(logits_ptr, max_ptr, sum_exp_ptr, sum_exp_z_ptr, stride_row, num_cols, BLOCK: tl.constexpr):
    """Program `row`: over columns [0, num_cols) of its row, the max m, sum exp(z - m) and sum exp(z - m) * z."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    running_max = float("-inf")
    sum_exp = 0.0
    sum_exp_z = 0.0
    for start in range(0, num_cols, BLOCK):
        inside = start + cols < num_cols
        z = tl.load(base + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, axis=0))  # finite: every tile holds a real column
        rescale = tl.exp(running_max - new_max)
        e = tl.exp(z - new_max)  # 0 outside the row
        sum_exp = sum_exp * rescale + tl.sum(e, axis=0)
        sum_exp_z = sum_exp_z * rescale + tl.sum(tl.where(inside, e * z, 0.0), axis=0)
        running_max = new_max
    tl.store(max_ptr + row, running_max)
    tl.store(sum_exp_ptr + row, sum_exp)
    tl.store(sum_exp_z_ptr + row, sum_exp_z)


@triton.jit
def _grad_kernel(logits_ptr, grad_ptr, log_norm_ptr, mean_z_ptr, grad_logprob_ptr, grad_entropy_ptr, target_ptr,
                 stride_row, stride_grad_row, num_valid, num_cols,
                 HAS_LOGPROB: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, tile): d/dz of grad_logprob * logp(target) + grad_entropy * entropy over one column tile,
    -p * (grad_logprob + grad_entropy * (z - E_p[z])) plus grad_logprob at the target column; 0 past num_valid."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < num_valid
    z = tl.load(logits_ptr + row * stride_row + cols, mask=valid, other=0.0).to(tl.float32)
    probs = tl.exp(z - tl.load(log_norm_ptr + row))
    coefficient = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_LOGPROB:
        coefficient += tl.load(grad_logprob_ptr + row)
    if HAS_ENTROPY:
        coefficient += tl.load(grad_entropy_ptr + row) * (z - tl.load(mean_z_ptr + row))
    grad = -(probs * coefficient)
    if HAS_LOGPROB:
        target = tl.load(target_ptr + row)  # -1 where another rank holds the target column
        grad += tl.where(cols == target, tl.load(grad_logprob_ptr + row), 0.0)
    grad = tl.where(valid, grad, 0.0)
    tl.store(grad_ptr + row * stride_grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < num_cols)


def _unit_column_stride(logits: Tensor) -> Tensor:
    """The kernels index columns by offset: a row's columns must be adjacent (the LM head's output is)."""
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def block_stats(logits: Tensor, num_valid: int) -> tuple[Tensor, Tensor, Tensor]:
    """logits [T, V/tp] (any float dtype, unit column stride) -> (max, sum exp(z - max), sum exp(z - max) * z),
    each [T] fp32, over the first `num_valid` columns (max -inf and sums 0 when there are none)."""
    logits = _unit_column_stride(logits)
    num_tokens = logits.shape[0]
    stats = torch.empty(3, num_tokens, dtype=torch.float32, device=logits.device)
    if num_tokens:
        _stats_kernel[(num_tokens,)](logits, stats[0], stats[1], stats[2], logits.stride(0), num_valid,
                                     BLOCK=BLOCK, num_warps=NUM_WARPS)
    return stats[0], stats[1], stats[2]


def block_grad(logits: Tensor, log_norm: Tensor, mean_z: Tensor, grad_logprob: Tensor | None,
               grad_entropy: Tensor | None, local_target: Tensor, num_valid: int) -> Tensor:
    """The logits' gradient [T, V/tp] in their dtype (see `_grad_kernel`); `local_target` [T] int holds the target's
    column in this block, or -1."""
    logits = _unit_column_stride(logits)
    num_tokens, num_cols = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if num_tokens and num_cols:
        unused = log_norm  # the pointer of an absent upstream gradient is never read
        _grad_kernel[(num_tokens, triton.cdiv(num_cols, BLOCK))](
            logits, grad, log_norm, mean_z, unused if grad_logprob is None else grad_logprob.float().contiguous(),
            unused if grad_entropy is None else grad_entropy.float().contiguous(), local_target,
            logits.stride(0), grad.stride(0), num_valid, num_cols,
            HAS_LOGPROB=grad_logprob is not None, HAS_ENTROPY=grad_entropy is not None, BLOCK=BLOCK,
            num_warps=NUM_WARPS)
    return grad
