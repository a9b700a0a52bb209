"""Weight gradients fused into the fp32 main_grad on CUDA (`data.accumulate_weight_grad`, called by the linears):
over several micro batches of bf16 column- and row-parallel linears, main_grad equals sum_mb grad^T x computed in
fp64 from the same bf16 tensors to fp32 precision (rounding each micro batch's gradient to bf16 first, the unfused
path, is ~1e-3 off), no bf16 `.grad` is left on the weights, biases still accumulate through the hook, input
gradients are unchanged, and a backward after `finalize` is refused as on the hook path."""

from __future__ import annotations

import pytest
import torch

from shardrl.parallel.data import GradBuffers
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.tensor import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.gpu


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
