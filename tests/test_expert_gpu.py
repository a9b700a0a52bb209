"""MoE on CUDA: the grouped-GEMM fast path against the per-expert loop, and the EP/ETP matrix over NCCL."""

import pytest
import torch

from shardrl.parallel.grouped_gemm import can_use_grouped_mm, expert_ffn
from test_expert import H, F_SIZE, full_weights
from test_expert_parallel import check_layouts

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ffn_and_grads(x, counts, w, grouped: bool, grad_out):
    x = x.clone().requires_grad_()
    weights = [w[k].clone().requires_grad_() for k in ("gate", "up", "down")]
    out = expert_ffn(x, counts, *weights, grouped=grouped)
    (out.float() * grad_out).sum().backward()
    return [out.float(), x.grad.float()] + [p.grad.float() for p in weights]


@needs_cuda
@pytest.mark.parametrize("hidden, ffn, counts", [(64, 32, [5, 0, 17, 3]), (128, 64, [0, 0, 40, 1]),
                                                 (H * 4, F_SIZE * 4, [0, 0, 0, 0])])
def test_grouped_mm_matches_loop_in_bf16(hidden, ffn, counts):
    device = torch.device("cuda")
    w32 = {k: v.to(device) for k, v in full_weights(7, hidden, ffn, len(counts)).items()}
    counts = torch.tensor(counts, device=device)
    x32 = torch.randn(int(counts.sum()), hidden, device=device)
    grad_out = torch.randn(int(counts.sum()), hidden, device=device)
    w16 = {k: v.bfloat16() for k, v in w32.items()}
    assert can_use_grouped_mm(x32.bfloat16(), w16["gate"], w16["down"])
    grouped = _ffn_and_grads(x32.bfloat16(), counts, w16, True, grad_out)
    looped = _ffn_and_grads(x32.bfloat16(), counts, w16, False, grad_out)
    exact = _ffn_and_grads(x32, counts, w32, False, grad_out)  # fp32 reference
    for name, g, lp, ref in zip(("out", "dx", "dgate", "dup", "ddown"), grouped, looped, exact):
        scale = ref.abs().max().clamp(min=1.0)
        # Both bf16 paths sit within bf16 rounding of the fp32 reference, and of each other.
        assert (g - ref).abs().max() <= 2e-2 * scale, name
        assert (g - lp).abs().max() <= 2e-2 * scale, name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ep2_and_etp2_on_nccl():
    check_layouts({"ep2": dict(ep=2), "etp2": dict(etp=2)}, tokens_per_rank=[7, 3], backend="nccl")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_four_rank_layouts_on_nccl():
    check_layouts({"ep4": dict(ep=4), "ep2xetp2": dict(ep=2, etp=2), "tp2xep2": dict(tp=2, ep=2)},
                  tokens_per_rank=[6, 0, 9, 4], backend="nccl")
