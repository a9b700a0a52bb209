"""Weight gradients fused into the fp32 main_grad on CUDA (`data.accumulate_weight_grad`, called by the linears):
over several micro batches of bf16 column- and row-parallel linears, main_grad equals sum_mb grad^T x computed in
fp64 from the same bf16 tensors to fp32 precision (rounding each micro batch's gradient to bf16 first, the unfused
path, is ~1e-3 off), no bf16 `.grad` is left on the weights, biases still accumulate through the hook, input
gradients are unchanged, and a backward after `finalize` is refused as on the hook path. The experts' grouped-GEMM
weight gradients and the hook's bf16 gradients are added into main_grad by one Triton pass (`add_into_main_grad`),
bit for bit what torch's mixed-dtype `add_` gives."""

from __future__ import annotations

import pytest
import torch

from shardrl.parallel.data import GradBuffers
from shardrl.parallel.expert import MoELayer
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.tensor import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kind", ["column", "row"])
def test_weight_gradient_accumulates_into_main_grad_in_fp32(kind):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    layout = Layout.create(LayoutSpec(world_size=1), device=device)
    gen = torch.Generator().manual_seed(0)
    in_size, out_size, tokens = 512, 384, 1000
    if kind == "column":
        layer = ColumnParallelLinear(in_size, out_size, layout, "layer", bias=True, dtype=torch.bfloat16)
    else:
        layer = RowParallelLinear(in_size, out_size, layout, "layer", bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_size, in_size, generator=gen) * 0.05)
        layer.bias.zero_()
    buffers = GradBuffers(layer.parameters(), layout)
    buffers.zero()
    want_w = torch.zeros(out_size, in_size, dtype=torch.float64)
    want_b = torch.zeros(out_size, dtype=torch.float64)
    for _ in range(4):  # micro batches
        x = (torch.randn(tokens, in_size, generator=gen) * 3).to(device, torch.bfloat16).requires_grad_()
        grad = torch.randn(tokens, out_size, generator=gen).to(device, torch.bfloat16)
        layer(x).backward(grad)
        want_w += grad.double().t().cpu() @ x.detach().double().cpu()
        want_b += grad.double().sum(0).cpu()
        want_x = (grad.double() @ layer.weight.detach().double()).cpu()
        assert torch.allclose(x.grad.double().cpu(), want_x, rtol=1.6e-2, atol=1e-2)
    assert layer.weight.grad is None  # never materialised: added into main_grad by the GEMM
    err = ((layer.weight.main_grad.double().cpu() - want_w).abs().max() / want_w.abs().max()).item()
    assert err < 1e-5, f"weight main_grad relative error {err:.1e} (fused fp32 accumulation gives ~1e-6..1e-5)"
    assert torch.allclose(layer.bias.main_grad.double().cpu(), want_b, rtol=1e-2, atol=0.5)  # bf16 grads via the hook
    buffers.finalize()
    x = torch.randn(8, in_size, device=device, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="backward after finalize"):
        layer(x).sum().backward()


@needs_cuda
@pytest.mark.parametrize("numel", [16 * 4096 * 3, 1_000_003, 5])  # the fast launch, Triton's own (odd size), tiny
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_add_kernel_is_torch_add_bit_for_bit(numel, dtype):
    from shardrl.parallel.grad_add_kernel import add_into_fp32

    gen = torch.Generator(device="cuda").manual_seed(numel)
    main = torch.randn(numel, device="cuda", generator=gen) * 3
    grad = torch.randn(numel, device="cuda", generator=gen).to(dtype)
    before = main.clone()
    want = main.clone().add_(grad)  # torch's mixed-dtype addition
    add_into_fp32(main, grad)
    assert torch.equal(main, want)
    assert not torch.equal(main, before)


@needs_cuda
def test_expert_weight_gradients_go_into_main_grad():
    """An MoE layer on the grouped path over four micro batches: each expert weight's main_grad is the fp32 sum of
    the micro batches' bf16 gradients (against a reference layer without gradient buffers, on torch's own grouped
    GEMM autograd, whose `.grad`s are added with torch: equal up to the bf16 rounding of each gradient), no `.grad`
    is stored, the input gradients match, and a backward after finalize is refused."""
    from test_expert import E, F_SIZE, H, K, NAMES

    device = torch.device("cuda")
    hidden, ffn = H * 8, F_SIZE * 8  # multiples of 8: the grouped GEMM's alignment
    layout = Layout.create(LayoutSpec(world_size=1), device=device)
    layers = [MoELayer(hidden, ffn, E, K, layout, NAMES, norm_topk_prob=True, dtype=torch.bfloat16) for _ in "ab"]
    layers[1].load_state_dict(layers[0].state_dict())
    ours, reference = layers
    buffers = GradBuffers(ours.parameters(), layout)
    buffers.zero()
    names = ("w_gate", "w_up", "w_down")
    want = {n: torch.zeros_like(getattr(ours, n), dtype=torch.float32) for n in names}
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):  # micro batches
        x = torch.randn(300, hidden, generator=gen).to(device, torch.bfloat16)
        grad = torch.randn(300, hidden, generator=gen).to(device, torch.bfloat16)
        x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours(x_ours).backward(grad)
        reference.zero_grad(set_to_none=True)
        reference(x_ref).backward(grad)
        for n in names:
            want[n].add_(getattr(reference, n).grad)
        torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1.6e-2, atol=1e-2 * x_ref.grad.abs().max().item())
    for n in names:
        param = getattr(ours, n)
        assert param.grad is None, n  # added into main_grad by the backward, not held by autograd
        assert want[n].abs().sum() > 0, n
        scale = want[n].abs().max().item()
        torch.testing.assert_close(param.main_grad, want[n], rtol=0, atol=1e-2 * scale, msg=n)
    assert ours.router.weight.main_grad.abs().sum() > 0  # the router's (an nn.Linear) through the hook
    buffers.finalize()
    with pytest.raises(RuntimeError, match="backward after finalize"):
        ours(torch.randn(8, hidden, device=device, dtype=torch.bfloat16)).sum().backward()
