"""RMSNorm's Triton kernels on one GPU against torch's ops in float64: the forward, both gradients, the residual
stream's gradient that the backward adds into the input's, and which path the module takes (a pass that builds a
graph runs the kernels; a forward-only pass keeps torch's fused normalisation)."""

from __future__ import annotations

import pytest
import torch

from shardrl.models.norm import RMSNorm, rms_norm as reference_rms_norm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return ((a.double() - b.double()).norm() / b.double().norm()).item() < rel


@pytest.mark.parametrize("rows,width", [(8192, 2048), (777, 64), (3, 896), (0, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_backward_is_the_reference_gradient(rows: int, width: int, with_residual: bool):
    from shardrl.models.norm_kernel import rms_norm_backward

    g = torch.Generator("cuda").manual_seed(rows + width)
    x = torch.randn(rows, width, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.rand(width, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    grad = torch.randn(rows, width, device="cuda", generator=g, dtype=torch.bfloat16)
    residual = torch.randn(rows, width, device="cuda", generator=g, dtype=torch.bfloat16) if with_residual else None
    grad_x, grad_w = rms_norm_backward(grad, x, w, 1e-6, residual)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    loss = (reference_rms_norm(x64, w64, 1e-6) * grad.double()).sum()
    if with_residual:
        loss = loss + (x64 * residual.double()).sum()
    loss.backward()
    if rows:
        assert _close(grad_x, x64.grad, 1e-2) and _close(grad_w, w64.grad, 1e-2)
    else:
        assert grad_x.shape == (0, width) and torch.equal(grad_w, torch.zeros_like(grad_w))


def test_module_in_a_residual_block_matches_autograd_of_torch_ops():
    """The block a decoder layer builds: normed, h = norm.with_residual(x); out = h + normed @ W; out2 = final
    norm(out). Forward, x's gradient (through both the normalisation and the residual stream) and the weights'
    gradients against the same block in torch ops, float64."""
    g = torch.Generator("cuda").manual_seed(7)
    tokens, width = 1000, 512
    x = torch.randn(tokens, width, device="cuda", generator=g, dtype=torch.bfloat16)
    proj = torch.randn(width, width, device="cuda", generator=g, dtype=torch.bfloat16) / width ** 0.5
    upstream = torch.randn(tokens, width, device="cuda", generator=g, dtype=torch.bfloat16)
    norms = [RMSNorm(width, 1e-6, f"norm{i}", device=torch.device("cuda"), dtype=torch.bfloat16) for i in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(torch.rand(width, device="cuda", generator=g) + 0.5)

    x_kernel = x.clone().requires_grad_()
    normed, h = norms[0].with_residual(x_kernel)
    assert type(normed.grad_fn).__name__ == "_KernelRMSNormBackward", "the training pass did not run the kernel"
    out = norms[1](h + normed @ proj)
    (out * upstream).sum().backward()

    x64 = x.double().requires_grad_()
    weights64 = [norm.weight.detach().double().requires_grad_() for norm in norms]
    out64 = reference_rms_norm(x64 + reference_rms_norm(x64, weights64[0], 1e-6) @ proj.double(), weights64[1], 1e-6)
    (out64 * upstream.double()).sum().backward()
    assert _close(out, out64, 1e-2)
    assert _close(x_kernel.grad, x64.grad, 2e-2)
    for norm, weight64 in zip(norms, weights64):
        assert _close(norm.weight.grad, weight64.grad, 2e-2)


def test_training_forward_equals_the_forward_without_autograd():
    """Old log-probs come from a pass without autograd: the training pass must see the same activations, bit for
    bit, so that the first update's ratio is exactly 1 (bitwise mode: its own kernel in both)."""
    g = torch.Generator("cuda").manual_seed(5)
    x = torch.randn(2048, 896, device="cuda", generator=g, dtype=torch.bfloat16)
    for bitwise in (False, True):
        norm = RMSNorm(896, 1e-6, "norm", device=torch.device("cuda"), dtype=torch.bfloat16, bitwise=bitwise)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(896, device="cuda", generator=g) + 0.5)
            without_grad = norm(x)
        normed, _ = norm.with_residual(x.clone().requires_grad_())
        assert type(normed.grad_fn).__name__ == "_KernelRMSNormBackward"
        assert torch.equal(normed, without_grad), bitwise


def test_forward_only_keeps_torch_fused_normalisation():
    g = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(64, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    norm = RMSNorm(256, 1e-6, "norm", device=torch.device("cuda"), dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(256, device="cuda", generator=g) + 0.5)
        normed, h = norm.with_residual(x)
        assert torch.equal(normed, reference_rms_norm(x, norm.weight, 1e-6)) and h is x
