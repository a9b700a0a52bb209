"""The MoE row kernels (`parallel/moe_rows_kernel.py`, what CUDA runs) against the portable path of
`parallel/moe_rows.py` in fp64 on the same inputs: the combine's values, the gradients of expert rows, router
weights and dispatched tokens, fp32 and bf16, hidden sizes that do and do not fill a tile, no tokens at all. Each
function gets leaf inputs, so the kernels' only rounding is their outputs' (fp32 sums inside)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from shardrl.parallel.moe_rows import combine_rows, dispatch_rows

pytestmark = pytest.mark.gpu
SHAPES = [(7, 2, 100), (300, 4, 2048), (129, 8, 1024 + 3), (0, 2, 64)]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    """`got` (CUDA, dtype) against the fp64 reference rounded once to dtype: one rounding apart at most."""
    assert got.dtype == dtype and got.shape == want.shape, name
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    assert_close(got.double().cpu(), want.to(dtype).double(), **tol, msg=lambda m: f"{name}: {m}")


def _case(shape, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    num_tokens, top_k, hidden = shape
    gen = torch.Generator().manual_seed(hidden)
    experts = torch.randint(0, 16, (num_tokens, top_k), generator=gen)
    order = experts.flatten().argsort(stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return gen, order, inverse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_combine_matches_the_portable_path(shape, dtype):
    gen, order, inverse = _case(shape, dtype)
    num_tokens, top_k, hidden = shape
    y = torch.randn(num_tokens * top_k, hidden, generator=gen).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(dtype)
    grad_out = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    results = []
    for device, as_dtype in (("cuda", dtype), ("cpu", torch.float64)):
        leaves = [t.to(device, as_dtype).requires_grad_() for t in (y, weights)]
        out = combine_rows(leaves[0], order.to(device), inverse.to(device), leaves[1])
        out.backward(grad_out.to(device, as_dtype))
        results.append((out, leaves[0].grad, leaves[1].grad))
    for got, want, name in zip(*results, ("out", "y.grad", "weights.grad")):
        _close(got, want, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_dispatch_backward_matches_the_portable_path(shape, dtype):
    gen, order, inverse = _case(shape, dtype)
    num_tokens, top_k, hidden = shape
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    grad_rows = torch.randn(num_tokens * top_k, hidden, generator=gen).to(dtype)
    results = []
    for device, as_dtype in (("cuda", dtype), ("cpu", torch.float64)):
        leaf = x.to(device, as_dtype).requires_grad_()
        rows = dispatch_rows(leaf, order.to(device), inverse.to(device), top_k)
        rows.backward(grad_rows.to(device, as_dtype))
        results.append((rows, leaf.grad))
    for got, want, name in zip(*results, ("rows", "x.grad")):
        _close(got, want, dtype, name)
