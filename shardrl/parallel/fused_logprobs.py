"""Log-probs and entropies straight from the hidden states and the vocab-parallel LM head, never holding the logits
of more than one token chunk (verl's `use_fused_kernels`: its fused linear + cross-entropy).

The unfused path (`Transformer.compute_logits`, then `vocab.vocab_parallel_logprobs`) keeps the [T, V/tp] logits
alive from the forward to the backward: at a 152k vocabulary and 16k tokens, 4.9 GB in bf16 per TP rank, plus the
fp32 gradient of the same shape in the backward. Here the forward runs the LM head GEMM one token chunk at a time and
keeps only each token's softmax statistics (`vocab.block_softmax_stats`, the kernels of the unfused path); the
backward recomputes each chunk's logits, takes their gradient (`vocab.block_logits_grad`) and turns it at once into
the chunk's hidden-state gradient and its share of the LM head's weight gradient. The maths is the unfused path's:
the same logits per token (one GEMM row each, divided by the temperature in the model dtype), the same statistics
and normaliser, so results agree to float rounding. The cost is one more LM head GEMM in the backward.

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
    and weight. Token chunks of about `chunk_elements` logits at a time."""
    return _FusedLogProbs.apply(hidden, weight, targets, group, vocab_size, temperature, chunk_elements)


def _chunk_logits(hidden: Tensor, weight: Tensor, num_valid: int, temperature: float) -> Tensor:
    """[C, V'/tp] a chunk's logits over this rank's real columns, scaled as `Transformer.scaled_logits` scales."""
    logits = F.linear(hidden, weight[:num_valid])
    return logits / temperature if temperature != 1.0 else logits


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, group: Group, vocab_size: int,
                temperature: float, chunk_elements: int) -> tuple[Tensor, Tensor]:
        num_tokens, num_local = hidden.shape[0], weight.shape[0]
        start = group_rank(group) * num_local
        num_valid = min(max(vocab_size - start, 0), num_local)  # this rank's real vocab rows
        index, mine = local_columns(targets.unsqueeze(-1), start, num_valid)  # [T, 1] each
        stats = hidden.new_empty(4, num_tokens, dtype=torch.float32)  # max, sum exp, sum exp * z, target z
        for lo, hi in token_chunks(num_tokens, num_valid, chunk_elements) if num_tokens else []:
            z = _chunk_logits(hidden[lo:hi], weight, num_valid, temperature)  # [C, V'/tp]
            stats[0, lo:hi], stats[1, lo:hi], stats[2, lo:hi] = block_softmax_stats(z, chunk_elements)
            stats[3, lo:hi] = held_values(z, index[lo:hi], mine[lo:hi]).squeeze(-1)
        log_norm, mean_z, target_z = combine_block_stats(stats[0], stats[1], stats[2], group, stats[3:].T)
        ctx.save_for_backward(hidden, weight, log_norm, mean_z, index, mine.squeeze(-1))
        ctx.num_valid, ctx.temperature, ctx.chunk_elements = num_valid, temperature, chunk_elements
        ctx.set_materialize_grads(False)
        return target_z.squeeze(-1) - log_norm, log_norm - mean_z

    @staticmethod
    def backward(ctx, grad_logprob: Tensor | None, grad_entropy: Tensor | None):
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 7
        hidden, weight, log_norm, mean_z, index, mine = ctx.saved_tensors
        num_valid, temperature, chunk_elements = ctx.num_valid, ctx.temperature, ctx.chunk_elements
        grad_hidden = torch.zeros_like(hidden)  # [T, H]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # [Vp/tp, H]; padding 0
        for lo, hi in token_chunks(hidden.shape[0], num_valid, chunk_elements) if num_valid else []:
            chunk = slice(lo, hi)
            z = _chunk_logits(hidden[chunk], weight, num_valid, temperature)  # [C, V'/tp]
            g = block_logits_grad(z, log_norm[chunk], mean_z[chunk],
                                  None if grad_logprob is None else grad_logprob[chunk],
                                  None if grad_entropy is None else grad_entropy[chunk], index[chunk], mine[chunk],
                                  num_valid, chunk_elements)  # [C, V'/tp] d/dz of the scaled logits
            if temperature != 1.0:
                g = g / temperature
            grad_hidden[chunk] = g @ weight[:num_valid]
            grad_weight[:num_valid].addmm_(g.T.float(), hidden[chunk].float())
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None
