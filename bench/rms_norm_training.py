"""A decoder layer's RMSNorm in training, forward + backward: torch's ops (the fused normalisation, the weight's
multiply, their autograd backward, and autograd's add of the residual stream's gradient) against the training path
(`models/norm.py`: torch's forward, then the Triton backward of `models/norm_kernel.py`, one pass that also adds the
residual stream's gradient), on the same tensors, same process (GPU only).

The block timed is `y = h + norm(h)`: h is the residual stream, so its gradient is the normalisation's plus the
one flowing past it, as in every decoder layer (twice per layer). Shapes: one micro batch of `bench/train_mfu.py`
(8192 tokens, width 2048) and a wider model's. Prints milliseconds per forward + backward (CUDA events), the
ratio, and each path's largest relative error of h's and the weight's gradients against float64. A block this small
is host-bound when called alone (autograd's and the launches' host time exceed the kernels'), so both are printed:
the wall time per call (CUDA events) and the GPU's kernel time per call (the profiler's kernel durations, which its
own host cost does not lengthen); inside a training step the host runs ahead and only the kernel time counts.

    PYTHONPATH=. python bench/rms_norm_training.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from cuda_timing import cuda_ms
from shardrl.models.norm import RMSNorm, rms_norm

SHAPES = [(8192, 2048), (8192, 4096), (16384, 896)]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("rms_norm_training: needs a CUDA GPU")
    for tokens, width in SHAPES:
        g = torch.Generator("cuda").manual_seed(0)
        h = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        upstream = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, generator=g)
        norm = RMSNorm(width, 1e-6, "norm", device=torch.device("cuda"), dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(width, device="cuda", generator=g) + 0.5)

        def torch_ops() -> tuple[torch.Tensor, ...]:
            y = h + rms_norm(h, norm.weight, norm.eps)
            return torch.autograd.grad(y, (h, norm.weight), upstream)

        def kernels() -> tuple[torch.Tensor, ...]:
            normed, stream = norm.with_residual(h)
            return torch.autograd.grad(stream + normed, (h, norm.weight), upstream)

        h64, w64 = h.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
        reference = torch.autograd.grad(h64 + rms_norm(h64, w64, norm.eps), (h64, w64), upstream.double())
        errors = [max(relative_error(got, want) for got, want in zip(fn(), reference)) for fn in (torch_ops, kernels)]
        (ops_wall, ops_gpu), (kernel_wall, kernel_gpu) = (timed(fn) for fn in (torch_ops, kernels))
        print(f"[{tokens} x {width}] bf16: GPU kernel time torch ops {ops_gpu:.3f} ms, kernels {kernel_gpu:.3f} ms -> "
              f"{ops_gpu / kernel_gpu:.2f}x (wall per call {ops_wall:.3f} -> {kernel_wall:.3f} ms); largest "
              f"relative error {errors[0]:.1e} -> {errors[1]:.1e}")


def timed(fn: Callable[[], object], iters: int = 20) -> tuple[float, float]:
    """(wall milliseconds per call by CUDA events, summed kernel milliseconds per call by the profiler)."""
    wall = cuda_ms(fn, iters=iters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
    return wall, kernel_us / 1e3 / iters


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


if __name__ == "__main__":
    main()
