"""Models on CUDA: the varlen flash-attention fast path against the portable reference, a bf16 model against the
fp32 CPU one, and the TP layers and HF parity over NCCL (two GPUs)."""

import pytest
import torch
from torch.testing import assert_close

from shardrl.models.attention import PackedSeqs, fa4_unavailable, packed_attention, reference_attention
from shardrl.models.config import ModelConfig
from shardrl.models.fast_paths import FastPaths
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.tiny import make_tiny_checkpoint, packed_batch
from shardrl.models.transformer import Transformer
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from test_models_parallel import DENSE, MOE, make_cases, run_layouts
from test_tensor_parallel import save_layer_weights, tp2_layers

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def needs_fa4(head_dim: int = 64) -> pytest.MarkDecorator:
    """Skip where FlashAttention-4 cannot run this head size (no GPU, another GPU, the package not installed)."""
    reason = fa4_unavailable(torch.device("cuda"), head_dim) if torch.cuda.is_available() else "needs CUDA"
    return pytest.mark.skipif(reason is not None, reason=reason or "")


KERNELS = ["flash", pytest.param("fa4", marks=needs_fa4())]


@needs_cuda
@pytest.mark.parametrize("kernel", KERNELS)
def test_varlen_fast_path_matches_reference_attention(kernel):
    lengths, num_heads, num_kv, head_dim = [5, 17, 1, 40, 300], 8, 2, 64
    cu_seqlens = torch.tensor([0, *lengths], device="cuda").cumsum(0, dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), n, head_dim, device="cuda", generator=g)
               for n in (num_heads, num_kv, num_kv))
    grad_out = torch.randn(sum(lengths), num_heads, head_dim, device="cuda", generator=g)
    outputs = []
    for dtype in (torch.bfloat16, torch.float32):  # bf16 takes the fused kernel, fp32 the reference
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        seqs = PackedSeqs(cu_seqlens, max(lengths), torch.empty(0), torch.empty(0))
        out = packed_attention(*leaves, seqs, head_dim ** -0.5, kernel=kernel)
        (out.float() * grad_out).sum().backward()
        outputs.append([out.float()] + [t.grad.float() for t in leaves])
    reference = reference_attention(q, k, v, cu_seqlens, head_dim ** -0.5)
    assert_close(outputs[1][0], reference)
    for fast, exact in zip(*outputs):
        assert_close(fast, exact, atol=3e-2, rtol=3e-2)


@needs_cuda
@pytest.mark.parametrize("family", ["qwen3", "qwen2_moe"])
def test_bf16_model_on_cuda_follows_fp32_on_cpu(tmp_path, family):
    ckpt = make_tiny_checkpoint(family, tmp_path)
    input_ids, position_ids, cu_seqlens = packed_batch([9, 24, 3], vocab_size=128)
    config = ModelConfig.from_pretrained(ckpt)
    results = []
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        model = Transformer(config, Layout.single(device), dtype=dtype)
        load_hf_weights(model, ckpt)
        batch = [t.to(device) for t in (input_ids, position_ids, cu_seqlens)]
        logprobs, entropy = model.compute_logprobs(model(*batch), batch[0].roll(-1))
        (logprobs.sum() + entropy.sum()).backward()
        grad = model.layers[0].self_attn.q_proj.weight.grad.float().cpu()
        results.append((logprobs.detach().cpu(), entropy.detach().cpu(), grad))
    (lp32, ent32, grad32), (lp16, ent16, grad16) = results
    assert_close(lp16, lp32, atol=0.1, rtol=0.05)
    assert_close(ent16, ent32, atol=0.1, rtol=0.05)
    # bf16 rounding (and, for MoE, routing near-ties) perturbs gradients by a few percent, not their direction.
    assert torch.cosine_similarity(grad16.flatten(), grad32.flatten(), dim=0) > 0.99


@needs_fa4(head_dim=64)
def test_a_model_on_fa4_computes_what_it_computes_on_torchs_flash(tmp_path):
    """`FastPaths.attention` reaches every layer: the bf16 model's log-probs and gradients with FA4 match the same
    weights' with torch's flash attention within bf16 noise, and `auto` picks FA4 where it runs."""
    ckpt = make_tiny_checkpoint("qwen3", tmp_path, head_dim=64)
    input_ids, position_ids, cu_seqlens = packed_batch([9, 240, 3, 130], vocab_size=128)
    config = ModelConfig.from_pretrained(ckpt)
    batch = [t.to("cuda") for t in (input_ids, position_ids, cu_seqlens)]
    results = []
    for attention in ("flash", "fa4"):
        model = Transformer(config, Layout.single("cuda"), dtype=torch.bfloat16, fast=FastPaths(attention=attention))
        assert {layer.self_attn.kernel for layer in model.layers} == {attention}
        load_hf_weights(model, ckpt)
        logprobs, _ = model.compute_logprobs(model(*batch), batch[0].roll(-1))
        logprobs.sum().backward()
        results.append((logprobs.detach().float(), model.layers[0].self_attn.q_proj.weight.grad.float()))
    (lp_flash, grad_flash), (lp_fa4, grad_fa4) = results
    assert_close(lp_fa4, lp_flash, atol=5e-2, rtol=2e-2)
    assert torch.cosine_similarity(grad_fa4.flatten(), grad_flash.flatten(), dim=0) > 0.999
    auto = Transformer(config, Layout.single("cuda"), dtype=torch.bfloat16, fast=FastPaths(attention="auto"))
    assert auto.layers[0].self_attn.kernel == "fa4"


@needs_two
def test_tp2_layers_over_nccl(tmp_path):
    run_distributed(2, tp2_layers, save_layer_weights(tmp_path), backend="nccl")


@needs_two
def test_tp2_and_pp2_match_transformers_over_nccl(tmp_path):
    cases = make_cases(tmp_path / "tiny")
    run_layouts(cases, tmp_path, 2, [("tp2", dict(tp=2), DENSE + MOE, (False, True)),
                                     ("pp2", dict(pp=2), ["llama", "qwen2_moe"], (False,))], backend="nccl")
