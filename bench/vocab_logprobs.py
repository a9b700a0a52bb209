"""Vocab logprob/entropy maths of one training micro batch: the fused Triton kernels (`parallel/vocab_kernels.py`,
what CUDA runs) against the torch reference of `parallel/vocab.py` (what ran before them), on the same bf16 logits,
same process (GPU only).

Shapes are one micro batch of `bench/train_mfu.py` (8192 tokens) over the vocab block one rank holds. Prints
milliseconds per call (CUDA events, `cuda_timing.cuda_ms`) for the statistics (forward) and the logits'
gradient (backward, logprob and entropy upstream), the bytes each reads and writes per second, and the ratio.

    python bench/vocab_logprobs.py
"""

from __future__ import annotations

import torch

from cuda_timing import cuda_ms
from shardrl.parallel.vocab import LOGPROB_CHUNK_ELEMENTS, logits_grad_reference, softmax_stats_reference

# (name, tokens, vocab columns one rank holds)
SHAPES = [("Llama-3.2-1B vocab, TP1", 8192, 128256), ("Llama-3.2-1B vocab, TP2", 8192, 64128),
          ("Qwen vocab, TP1", 8192, 151936), ("Mixtral vocab, TP1", 8192, 32000)]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("vocab_logprobs: needs a CUDA GPU")
    from shardrl.parallel.vocab_kernels import block_grad, block_stats  # Triton: CUDA installs only

    for name, num_tokens, num_cols in SHAPES:
        logits = torch.randn(num_tokens, num_cols, device="cuda", dtype=torch.bfloat16) * 3
        targets = torch.randint(0, num_cols, (num_tokens,), device="cuda")
        mine = torch.ones(num_tokens, dtype=torch.bool, device="cuda")
        up_lp, up_ent = torch.randn(num_tokens, device="cuda"), torch.randn(num_tokens, device="cuda")
        z_max, sum_exp, sum_exp_z = softmax_stats_reference(logits, LOGPROB_CHUNK_ELEMENTS)
        log_norm, mean_z = z_max + sum_exp.log(), sum_exp_z / sum_exp
        size = logits.numel() * logits.element_size()
        ref_fwd = cuda_ms(lambda: softmax_stats_reference(logits, LOGPROB_CHUNK_ELEMENTS))
        fused_fwd = cuda_ms(lambda: block_stats(logits, num_cols))
        ref_bwd = cuda_ms(lambda: logits_grad_reference(logits, log_norm, mean_z, up_lp, up_ent, targets[:, None],
                                                      mine, num_cols, LOGPROB_CHUNK_ELEMENTS))
        fused_bwd = cuda_ms(lambda: block_grad(logits, log_norm, mean_z, up_lp, up_ent, targets.int(), num_cols))
        print(f"{name} [{num_tokens}, {num_cols}] bf16: forward torch {ref_fwd:.3f} ms, fused {fused_fwd:.3f} ms "
              f"({size / fused_fwd / 1e6:,.0f} GB/s, {ref_fwd / fused_fwd:.1f}x); backward torch {ref_bwd:.3f} ms, "
              f"fused {fused_bwd:.3f} ms ({2 * size / fused_bwd / 1e6:,.0f} GB/s, {ref_bwd / fused_bwd:.1f}x)")


if __name__ == "__main__":
    main()
