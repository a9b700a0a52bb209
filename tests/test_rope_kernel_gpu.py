"""The fused rotary kernel (`models/rope_kernel.py`, what CUDA runs) against `apply_rope` (the reference): values
and input gradients in fp32 and bf16, over head dims and head counts that do and do not fill a tile, for a strided
view of a wider projection output, as attention hands it over."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from shardrl.models.config import RopeConfig
from shardrl.models.rope import RotaryEmbedding, apply_rope, rotate

pytestmark = pytest.mark.gpu

# (tokens, heads, head_dim)
SHAPES = [(37, 5, 64), (1, 32, 64), (300, 7, 128), (9, 3, 8), (64, 16, 80)]


def _tables(num_tokens: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randperm(4096, device=device)[:num_tokens]
    return RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, device)(positions)  # fp32 [T, D] each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rotary_kernel_matches_apply_rope(shape, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from shardrl.models.rope_kernel import rotary  # Triton: CUDA installs only

    device = torch.device("cuda")
    torch.manual_seed(sum(shape))
    num_tokens, num_heads, head_dim = shape
    cos, signed_sin = _tables(num_tokens, head_dim, device)
    packed = torch.randn(num_tokens, (num_heads + 2) * head_dim, device=device)  # q plus one more head each side
    x = packed[:, head_dim:-head_dim].unflatten(-1, (num_heads, head_dim)).to(dtype)  # strided when fp32
    grad_out = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)  # what autograd hands over

    got_x = x.detach().requires_grad_()
    got = rotary(got_x, cos, signed_sin)
    got.backward(grad_out)
    ref_x = x.detach().double().requires_grad_()  # the reference in fp64 on the same (rounded) inputs
    ref = apply_rope(ref_x, cos.double(), signed_sin.double())
    ref.backward(grad_out.double())

    assert got.dtype == dtype and got_x.grad.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    assert_close(got.double(), ref.to(dtype).double(), **tol)
    assert_close(got_x.grad.double(), ref_x.grad.to(dtype).double(), **tol)


def test_rotate_switches_to_the_kernel_on_cuda_only():
    """`rotate` on CUDA equals the kernel bit for bit; on CPU it is `apply_rope` in the tensors' dtype."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from shardrl.models.rope_kernel import rotary

    q, k = torch.randn(11, 4, 64, device="cuda"), torch.randn(11, 2, 64, device="cuda")
    cos, signed_sin = _tables(11, 64, torch.device("cuda"))
    got_q, got_k = rotate(q, k, cos, signed_sin, compile=False)
    assert torch.equal(got_q, rotary(q, cos, signed_sin)) and torch.equal(got_k, rotary(k, cos, signed_sin))
    cpu_q, _ = rotate(q.cpu(), k.cpu(), cos.cpu(), signed_sin.cpu(), compile=False)
    assert torch.equal(cpu_q, apply_rope(q.cpu(), cos.cpu(), signed_sin.cpu()))
