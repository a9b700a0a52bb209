"""MoE on CUDA: the grouped-GEMM fast path against the per-expert loop, and the EP/ETP matrix over NCCL."""

import pytest
import torch

from shardrl.parallel.expert import MoELayer
from shardrl.parallel.grouped_gemm import ExpertAdapters, can_use_grouped_mm, expert_ffn
from shardrl.parallel.layout import Layout
from test_expert import F_SIZE, H, K, NAMES, copy_into_hf, full_weights, hf_block, load_full
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
        scale = max(_max_abs(ref), 1.0)
        # Both bf16 paths sit within bf16 rounding of the fp32 reference, and of each other.
        assert _max_abs(g - ref) <= 2e-2 * scale, name
        assert _max_abs(g - lp) <= 2e-2 * scale, name


def _max_abs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


@needs_cuda
def test_grouped_mm_backward_takes_a_broadcast_gradient():
    w = {k: v.cuda().bfloat16().requires_grad_() for k, v in full_weights(8, 64, 32, 3).items()}
    counts = torch.tensor([4, 0, 6], device="cuda")
    x = torch.randn(10, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    expert_ffn(x, counts, w["gate"], w["up"], w["down"], grouped=True).sum().backward()  # grad has stride 0
    grads = [x.grad] + [w[k].grad for k in ("gate", "up", "down")]
    x_ref = x.detach().clone().requires_grad_()
    w_ref = {k: v.detach().clone().requires_grad_() for k, v in w.items()}
    expert_ffn(x_ref, counts, w_ref["gate"], w_ref["up"], w_ref["down"], grouped=False).sum().backward()
    expected = [x_ref.grad] + [w_ref[k].grad for k in ("gate", "up", "down")]
    for g, ref in zip(grads, expected):
        assert _max_abs(g.float() - ref.float()) <= 2e-2 * max(_max_abs(ref.float()), 1.0)


def _adapted_ffn_and_grads(x, counts, w, factors, grouped: bool, grad_out):
    """Output and gradients (x, the three weights' none: frozen; every LoRA factor) of the adapted expert FFN."""
    x = x.clone().requires_grad_()
    tensors = {k: v.clone().requires_grad_() for k, v in factors.items()}
    adapters = ExpertAdapters(2.0, tensors["gate_up_a"], (tensors["gate_b"], tensors["up_b"]), tensors["down_a"],
                              tensors["down_b"])
    out = expert_ffn(x, counts, w["gate"], w["up"], w["down"], grouped=grouped, adapters=adapters)
    (out.float() * grad_out).sum().backward()
    return [out.float(), x.grad.float()] + [tensors[k].grad.float() for k in sorted(tensors)]


@needs_cuda
def test_grouped_mm_with_expert_adapters_matches_the_loop_in_bf16():
    """LoRA on the experts (gate/up sharing A, down) on the grouped path: the per-expert loop's output and factor
    gradients within bf16 rounding of fp32; a rank that is no multiple of 8 is not grouped-aligned."""
    device, rank, counts = torch.device("cuda"), 8, [5, 0, 17, 3]
    g = torch.Generator().manual_seed(9)
    hidden, ffn, experts = 64, 32, len(counts)
    w32 = {k: v.to(device) for k, v in full_weights(7, hidden, ffn, experts).items()}
    shapes = dict(gate_up_a=(rank, hidden), gate_b=(ffn, rank), up_b=(ffn, rank), down_a=(rank, ffn),
                  down_b=(hidden, rank))
    f32 = {k: (torch.randn(experts, *shape, generator=g) * 0.2).to(device) for k, shape in shapes.items()}
    counts = torch.tensor(counts, device=device)
    x32 = torch.randn(int(counts.sum()), hidden, device=device)
    grad_out = torch.randn(int(counts.sum()), hidden, device=device)
    w16, f16 = ({k: v.bfloat16() for k, v in d.items()} for d in (w32, f32))
    probe = ExpertAdapters(2.0, f16["gate_up_a"], (f16["gate_b"], f16["up_b"]), f16["down_a"], f16["down_b"])
    assert can_use_grouped_mm(x32.bfloat16(), w16["gate"], w16["down"], probe)
    odd = ExpertAdapters(2.0, f16["gate_up_a"][:, :3], (), None, None)
    assert not can_use_grouped_mm(x32.bfloat16(), w16["gate"], w16["down"], odd)
    grouped = _adapted_ffn_and_grads(x32.bfloat16(), counts, w16, f16, True, grad_out)
    exact = _adapted_ffn_and_grads(x32, counts, w32, f32, False, grad_out)
    plain = expert_ffn(x32, counts, w32["gate"], w32["up"], w32["down"], grouped=False)
    assert _max_abs(exact[0] - plain) > 0.1  # the adapters change the output
    names = ["out", "dx", *sorted(shapes)]
    for name, got, ref in zip(names, grouped, exact):
        assert _max_abs(got - ref) <= 2e-2 * max(_max_abs(ref), 1.0), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_rank_layouts_on_nccl():
    check_layouts({"ep2": dict(ep=2), "etp2": dict(etp=2), "tp2xep2": dict(tp=2, ep=2)}, tokens_per_rank=[7, 3],
                  backend="nccl")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_four_rank_layouts_on_nccl():
    check_layouts({"ep4": dict(ep=4), "ep2xetp2": dict(ep=2, etp=2), "tp2xep2": dict(tp=2, ep=2),
                   "tp2xep2xetp2": dict(tp=2, ep=2, etp=2)}, tokens_per_rank=[6, 0, 9, 4], backend="nccl")


@needs_cuda
def test_bf16_layer_on_grouped_path_matches_hf_block():
    block, norm_topk = hf_block("qwen3_norm", hidden=64, ffn=32, experts=8)
    w = full_weights(9, 64, 32, 8)
    copy_into_hf(block, w)
    layer = MoELayer(64, 32, 8, K, Layout.single("cuda"), NAMES, norm_topk_prob=norm_topk, dtype=torch.bfloat16)
    load_full(layer, w)
    block = block.cuda().bfloat16()
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    assert can_use_grouped_mm(x, layer.w_gate, layer.w_down)
    expected, ours = block(x.view(4, 16, 64)).view(64, 64).float(), layer(x).float()
    assert _max_abs(ours - expected) <= 2e-2 * max(_max_abs(expected), 1.0)
