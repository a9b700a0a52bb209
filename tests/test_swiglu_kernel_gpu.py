"""The fused SwiGLU kernels (`parallel/swiglu_kernel.py`, what CUDA runs) against silu(gate) * up in fp64 on the
same inputs: values and both input gradients, fp32 and bf16, rows that do and do not fill a tile, gate and up as
column slices of one packed projection output (strided rows)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from shardrl.parallel.activation import gated_silu, swiglu

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (37, 1408), (300, 2048 + 5), (8, 8192)])
def test_fused_swiglu_matches_reference(shape, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from shardrl.parallel.swiglu_kernel import fused_swiglu  # Triton: CUDA installs only

    torch.manual_seed(shape[1])
    num_rows, ffn = shape
    packed = (torch.randn(num_rows, 2 * ffn, device="cuda") * 3).to(dtype)  # [N, 2F]: gate columns, then up
    grad_out = torch.randn(num_rows, ffn, device="cuda").to(dtype)
    gate, up = (t.detach().requires_grad_() for t in packed.split(ffn, dim=-1))
    assert gate.stride(0) == 2 * ffn  # strided rows, as column_parallel hands them over
    out = fused_swiglu(gate, up)
    out.backward(grad_out)
    ref_gate, ref_up = (t.detach().double().requires_grad_() for t in packed.split(ffn, dim=-1))
    ref = swiglu(ref_gate, ref_up)
    ref.backward(grad_out.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    assert out.dtype == gate.grad.dtype == up.grad.dtype == dtype
    for got, want in ((out, ref), (gate.grad, ref_gate.grad), (up.grad, ref_up.grad)):
        assert_close(got.double(), want.to(dtype).double(), **tol)
    assert torch.equal(gated_silu(gate, up), out)  # the CUDA switch takes the kernel
