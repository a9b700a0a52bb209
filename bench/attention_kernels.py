"""Training attention: the trainer's packed causal attention (`models.attention.packed_attention`: flash attention's
varlen kernels with the KV heads as they are) against what it replaced and another kernel torch ships, forward and
forward + backward, same packed inputs, same process (GPU only).

Each shape is one layer's attention over one micro batch of packed sequences ([T, heads, head_dim] bf16):
  repeat-kv     the KV heads repeated to the query heads, then torch's public `varlen_attn` (the path before)
  cudnn-padded  cuDNN through SDPA on [N, heads, S, D] (only shapes whose sequences all have one length): what a
                faster kernel would give. cuDNN's varlen entry (`aten._cudnn_attention_forward` with sequence
                offsets) ran ~100x slower with garbage dq/dk in torch 2.11 (docs/benchmarks.md), so it is not offered
  fa4           the trainer's FlashAttention-4 path (`packed_attention(kernel="fa4")`: CuTe DSL kernels for Hopper and
                Blackwell, GQA native), when the optional flash-attn-4 package is installed; its first call per
                shape compiles (warm-up covers it). torch 2.11's own route to FA4
                (`activate_flash_attention_impl("FA4")`) failed against flash-attn-4 4.0.0b40 ("too many values to
                unpack": the two disagree on what the forward returns), so the trainer calls FA4 itself
Prints milliseconds per call (CUDA events, mean of the timed calls after warm-up), attention TFLOP/s (causal:
forward 2 * 2 * s^2 / 2 * heads * head_dim per sequence, backward 2.5x that with the recomputed scores), the ratio
of the baseline's time to each variant's, and each variant's max |diff| in output and input gradients against the
baseline. A variant the installed torch or GPU cannot run prints its error and is skipped.

    python bench/attention_kernels.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import cuda_ms
from shardrl.models.attention import PackedSeqs, fa4_unavailable, packed_attention

# (name, query heads, KV heads, head_dim, sequence lengths of one micro batch)
SHAPES = [
    ("train_mfu dense (Llama-3.2-1B)", 32, 8, 64, [4096, 4096]),
    ("Llama-3.2-1B, mixed lengths", 32, 8, 64, [3000, 1200, 2400, 700, 900]),
    ("Qwen2.5-3B shape", 16, 2, 128, [4096, 4096]),
    ("Qwen3-8B at TP2", 16, 4, 128, [2048, 1536, 3072, 1536]),
]
Attention = Callable[[Tensor, Tensor, Tensor, Tensor, int, float], Tensor]


def baseline(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    num_tokens = q.shape[0]
    seqs = PackedSeqs(cu, max_len, q.new_empty(num_tokens, 0), q.new_empty(num_tokens, 0))
    return packed_attention(q, k, v, seqs, scale)


def repeat_kv(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0))


def cudnn_padded(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    num_seqs = cu.numel() - 1
    if q.shape[0] != num_seqs * max_len:
        raise ValueError("sequences of unequal lengths")
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q4, k4, v4 = (x.unflatten(0, (num_seqs, max_len)).transpose(1, 2) for x in (q, k, v))  # [N, heads, S, D]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    return out.transpose(1, 2).flatten(0, 1)


def fa4(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    reason = fa4_unavailable(q.device, q.shape[-1])
    if reason is not None:
        raise RuntimeError(reason)
    num_tokens = q.shape[0]
    seqs = PackedSeqs(cu, max_len, q.new_empty(num_tokens, 0), q.new_empty(num_tokens, 0))
    return packed_attention(q, k, v, seqs, scale, kernel="fa4")


VARIANTS: dict[str, Attention] = {"repeat-kv": repeat_kv, "cudnn-padded": cudnn_padded, "fa4": fa4}


def run(attention: Attention, inputs: tuple[Tensor, ...], cu: Tensor, max_len: int, scale: float,
        grad_out: Tensor) -> tuple[float, float, list[Tensor]]:
    """(forward ms, forward + backward ms, [out, dq, dk, dv]) of one variant."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    with torch.no_grad():
        forward = cuda_ms(lambda: attention(*inputs, cu, max_len, scale))

    def step() -> Tensor:
        out = attention(*leaves, cu, max_len, scale)
        out.backward(grad_out)
        return out

    both = cuda_ms(step)
    for x in leaves:
        x.grad = None
    out = step()
    return forward, both, [out.detach()] + [x.grad for x in leaves]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("attention_kernels: needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    for name, num_heads, num_kv, head_dim, lengths in SHAPES:
        num_tokens = sum(lengths)
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
        q = torch.randn(num_tokens, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(num_tokens, num_kv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        grad_out = torch.randn_like(q)
        scale = head_dim ** -0.5
        flops = sum(2 * 2 * s * s / 2 * num_heads * head_dim for s in lengths)  # causal forward
        fwd, both, reference = run(baseline, (q, k, v), cu, max(lengths), scale, grad_out)
        print(f"{name}: {len(lengths)} seqs, {num_tokens} tokens, {num_heads} q / {num_kv} kv heads, D {head_dim}")
        print(f"  {'baseline':<13} fwd {fwd:7.3f} ms ({flops / fwd / 1e9:5.0f} TFLOP/s)  fwd+bwd {both:7.3f} ms "
              f"({3.5 * flops / both / 1e9:5.0f} TFLOP/s)")
        for variant, attention in VARIANTS.items():
            try:
                v_fwd, v_both, result = run(attention, (q, k, v), cu, max(lengths), scale, grad_out)
            except Exception as error:  # a kernel this torch build or GPU lacks: report it, measure the rest
                print(f"  {variant:<13} skipped: {str(error).splitlines()[0][:150]}")
                continue
            diffs = " ".join(f"{label} {(a.float() - b.float()).abs().max().item():.1e}"
                             for label, a, b in zip(("out", "dq", "dk", "dv"), result, reference))
            print(f"  {variant:<13} fwd {v_fwd:7.3f} ms ({fwd / v_fwd:4.2f}x)  fwd+bwd {v_both:7.3f} ms "
                  f"({both / v_both:4.2f}x, {3.5 * flops / v_both / 1e9:5.0f} TFLOP/s)  max|diff| {diffs}")


if __name__ == "__main__":
    main()
