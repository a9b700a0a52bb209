"""Log-probs + entropy of one training micro batch from the hidden states, forward and backward: the LM head GEMM
then the vocab kernels over the whole logits (what `model.use_fused_kernels=false` runs) against the fused path that
holds one token chunk of logits at a time (`parallel/fused_logprobs.py`), same process (GPU only).

Shapes: 8192 tokens (one `bench/train_mfu.py` micro batch) of a 1.24B Llama (hidden 2048, vocab 128256) and of
Qwen2.5-0.5B (hidden 896, vocab 151936), bf16, TP1. Prints each path's milliseconds (CUDA events) and peak memory
allocated above the inputs, and their ratios.

    python bench/fused_logprobs.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cuda_timing import cuda_ms
from shardrl.parallel.fused_logprobs import fused_vocab_parallel_logprobs
from shardrl.parallel.vocab import vocab_parallel_logprobs

SHAPES = [("Llama-3.2-1B shape", 8192, 2048, 128256), ("Qwen2.5-0.5B shape", 8192, 896, 151936)]


def step(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, fused: bool) -> None:
    """Forward and backward of sum(log-prob) + sum(entropy), gradients into hidden and weight."""
    hidden.grad = weight.grad = None
    if fused:
        log_prob, entropy = fused_vocab_parallel_logprobs(hidden, weight, targets, None, weight.shape[0])
    else:
        log_prob, entropy = vocab_parallel_logprobs(F.linear(hidden, weight), targets, None, weight.shape[0])
    (log_prob.sum() + entropy.sum()).backward()


def peak_mb(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("fused_logprobs: needs a CUDA GPU")
    for name, num_tokens, hidden_size, vocab in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(num_tokens, hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
        weight = torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        hidden.requires_grad_(), weight.requires_grad_()
        targets = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=g)
        results = {}
        for fused in (False, True):
            step(hidden, weight, targets, fused)  # warm up (kernels compiled, allocator primed)
            memory = peak_mb(lambda: step(hidden, weight, targets, fused))
            results[fused] = (cuda_ms(lambda: step(hidden, weight, targets, fused)), memory)
        (plain_ms, plain_mb), (fused_ms, fused_mb) = results[False], results[True]
        print(f"{name} [{num_tokens} x {hidden_size} -> {vocab}] bf16: unfused {plain_ms:.2f} ms, {plain_mb:,.0f} MiB; "
              f"fused {fused_ms:.2f} ms, {fused_mb:,.0f} MiB; time {fused_ms / plain_ms:.2f}x, memory "
              f"{fused_mb / plain_mb:.2f}x")


if __name__ == "__main__":
    main()
