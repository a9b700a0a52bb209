"""main (fp32) += grad (bf16 or fp16) in one vectorised Triton pass, for `data.add_into_main_grad` and the gradient
hook on CUDA.

Weight gradients that reach `main_grad` as a tensor of their own (the experts' from the grouped GEMMs, which have
no fp32 output; norms and biases through the hook) were added with `main_grad.add_(grad)`. torch runs that
mixed-dtype addition on its dynamic-casting elementwise path, which loads one element at a time: on the MoE bench
model 35 ms of a 0.56 s training step on one H200 (docs/benchmarks.md, session 19). This kernel reads each 16-byte
word once and adds in fp32, so the result is the same bits as torch's (fp32 + exactly widened grad, one rounding):
1.50x torch's on an expert weight's gradient, 4.1 TB/s (session 20).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from shardrl.parallel.triton_launch import FastKernel

BLOCK = 4096  # elements per program: 16 per thread at 8 warps, four 16-byte fp32 words


@triton.jit
def _add_kernel(main_ptr, grad_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    total = tl.load(main_ptr + offsets, mask=inside) + tl.load(grad_ptr + offsets, mask=inside).to(tl.float32)
    tl.store(main_ptr + offsets, total, mask=inside)


_ADD = FastKernel(_add_kernel)


def add_into_fp32(main: Tensor, grad: Tensor) -> None:
    """main += grad for contiguous CUDA tensors of the same shape, main fp32 and grad bf16 or fp16."""
    numel = main.numel()
    if numel:
        _ADD.launch((triton.cdiv(numel, BLOCK),), (main, grad), (numel,), num_warps=8, BLOCK=BLOCK)
