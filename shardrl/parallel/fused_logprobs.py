"""Log-probs and entropies straight from the hidden states and the vocab-parallel LM head, never holding more than
one chunk of the logits (verl's `use_fused_kernels`: its fused linear + cross-entropy).

The unfused path (`Transformer.compute_logits`, then `vocab.vocab_parallel_logprobs`) keeps the [T, V/tp] logits
alive from the forward to the backward: at a 152k vocabulary and 16k tokens, 4.9 GB in bf16 per TP rank, plus their
gradient of the same shape in the backward. Here chunks run along the vocabulary (every token, some LM head rows).
The forward runs each chunk's GEMM and keeps only each token's softmax statistics (`vocab.block_softmax_stats`, the
unfused path's kernels), merged over chunks as the TP ranks' blocks are. The backward recomputes each chunk's
logits, takes their gradient (`vocab.block_logits_grad`) and turns it at once into the chunk's rows of the LM head's
weight gradient (written whole: nothing the size of the weight accumulates) and its share of the small hidden-state
gradient [T, H]. The maths is the unfused path's (the same logits, divided by the temperature in the model dtype,
the same statistics and normaliser), so results agree to float rounding. The cost is one more LM head GEMM in the
backward.

Under tensor parallelism the hidden states enter as the unfused path's do (`enter_tp`: replicated over the TP group,
or all-gathered from sequence parallelism), so the hidden-state gradient returned here is this rank's block's part,
which `enter_tp`'s backward sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from shardrl.parallel.tensor import Group, group_rank
from shardrl.parallel.vocab import (
    LOGPROB_CHUNK_ELEMENTS,
    block_logits_grad,
    block_softmax_stats,
    combine_block_stats,
    held_values,
    local_columns,
    token_chunks,
)


def fused_vocab_parallel_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, group: Group, vocab_size: int,
                                  temperature: float = 1.0,
                                  chunk_elements: int = LOGPROB_CHUNK_ELEMENTS) -> tuple[Tensor, Tensor]:
    """hidden [T, H] (every token of the TP group), weight [Vp/tp, H] (this rank's LM head rows), targets [T] global
    ids -> (log-prob of each target, entropy), both [T] fp32 and the same on every TP rank; differentiable in hidden
    and weight. Vocab chunks of about `chunk_elements` logits at a time."""
    return _FusedLogProbs.apply(hidden, weight, targets, group, vocab_size, temperature, chunk_elements)


def _vocab_chunks(num_tokens: int, num_valid: int, chunk_elements: int) -> list[tuple[int, int]]:
    """Row ranges [lo, hi) of this rank's real LM head rows, `chunk_elements` / T rows each: one chunk's logits
    [T, hi - lo]. Cut along the vocabulary, so the backward writes each chunk's rows of the weight gradient once
    (its GEMM is whole) and only the small hidden-state gradient [T, H] accumulates over chunks."""
    return token_chunks(num_valid, num_tokens, chunk_elements)


def _chunk_logits(hidden: Tensor, weight: Tensor, lo: int, hi: int, temperature: float) -> Tensor:
    """[T, hi - lo] the logits of LM head rows lo..hi, scaled as `Transformer.scaled_logits` scales them."""
    logits = F.linear(hidden, weight[lo:hi])
    return logits / temperature if temperature != 1.0 else logits


def _merge(running: Tensor, block: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    """Two sets of softmax statistics over disjoint columns -> those of their union: `running` [4, T] (max, sum exp
    relative to it, sum exp * z relative to it, the target's logit where held), updated in place."""
    block_max, block_sum_exp, block_sum_exp_z, held = block
    new_max = torch.maximum(running[0], block_max)
    old, new = (running[0] - new_max).exp(), (block_max - new_max).exp()  # exp(-inf) = 0 on the first chunk
    running[1] = running[1] * old + block_sum_exp * new
    running[2] = running[2] * old + block_sum_exp_z * new
    running[3] += held
    running[0] = new_max
    return running


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, group: Group, vocab_size: int,
                temperature: float, chunk_elements: int) -> tuple[Tensor, Tensor]:
        num_tokens, num_local = hidden.shape[0], weight.shape[0]
        start = group_rank(group) * num_local
        num_valid = min(max(vocab_size - start, 0), num_local)  # this rank's real vocab rows
        running = hidden.new_zeros(4, num_tokens, dtype=torch.float32)  # max, sum exp, sum exp * z, target z
        running[0] = float("-inf")
        for lo, hi in _vocab_chunks(num_tokens, num_valid, chunk_elements) if num_tokens else []:
            z = _chunk_logits(hidden, weight, lo, hi, temperature)  # [T, hi - lo]
            index, mine = local_columns(targets.unsqueeze(-1), start + lo, hi - lo)  # [T, 1] each
            _merge(running, (*block_softmax_stats(z, chunk_elements), held_values(z, index, mine).squeeze(-1)))
        log_norm, mean_z, target_z = combine_block_stats(running[0], running[1], running[2], group,
                                                         running[3].unsqueeze(-1))
        ctx.save_for_backward(hidden, weight, targets, log_norm, mean_z)
        ctx.start, ctx.num_valid, ctx.temperature, ctx.chunk_elements = start, num_valid, temperature, chunk_elements
        ctx.set_materialize_grads(False)
        return target_z.squeeze(-1) - log_norm, log_norm - mean_z

    @staticmethod
    def backward(ctx, grad_logprob: Tensor | None, grad_entropy: Tensor | None):
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 7
        hidden, weight, targets, log_norm, mean_z = ctx.saved_tensors
        start, temperature, chunk_elements = ctx.start, ctx.temperature, ctx.chunk_elements
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
        grad_weight = torch.zeros_like(weight)  # [Vp/tp, H]; padding rows stay 0
        for lo, hi in _vocab_chunks(hidden.shape[0], ctx.num_valid, chunk_elements) if hidden.shape[0] else []:
            z = _chunk_logits(hidden, weight, lo, hi, temperature)  # [T, hi - lo]
            index, mine = local_columns(targets.unsqueeze(-1), start + lo, hi - lo)  # [T, 1] each
            g = block_logits_grad(z, log_norm, mean_z, grad_logprob, grad_entropy, index, mine.squeeze(-1), hi - lo,
                                  chunk_elements)  # [T, hi - lo] d/dz of the scaled logits, z's dtype
            if temperature != 1.0:
                g = g / temperature
            torch.mm(g.T, hidden, out=grad_weight[lo:hi])
            grad_hidden += (g @ weight[lo:hi]).float()
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None
