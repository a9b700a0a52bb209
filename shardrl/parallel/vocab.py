"""Vocab parallelism: the embedding and LM head split by vocab rows over TP, and the logprob / entropy maths over
the vocab blocks without ever gathering the full vocabulary (`gather_vocab` is for sampling and tests).

The vocab is padded to a multiple of TP; padded rows/columns (ids >= vocab_size) sit at the tail of the last blocks
and are excluded from every softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from shardrl.parallel.data import accumulate_embedding_grad, fills_main_grad
from shardrl.parallel.layout import Layout
from shardrl.parallel.spec import ShardSpec
from shardrl.parallel.tensor import Group, exit_tp, group_rank, group_size, sharded_param


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def vocab_spec(name: str, vocab_size: int, hidden_size: int, layout: Layout, tied_group: bool = False) -> ShardSpec:
    """Rows of an embedding / LM head split over TP after padding the vocab to a multiple of TP."""
    tp = layout.tp_size
    padded = padded_vocab_size(vocab_size, tp)
    return ShardSpec(name, (vocab_size, hidden_size), dim=0, num_shards=tp, index=layout.tp_rank,
                     padded_dim_size=padded if padded != vocab_size else None, group="tp", tied_group=tied_group)


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds a block of vocab rows; the lookups of the other blocks are zeros until the reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, layout: Layout, name: str, sequence_parallel: bool = False,
                 tied_group: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        spec = vocab_spec(name, vocab_size, hidden_size, layout, tied_group)
        self.weight = sharded_param(spec, layout, dtype)
        self.group, self.sequence_parallel = layout.tp_group, sequence_parallel
        self.start = layout.tp_rank * self.weight.shape[0]

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [T] -> [T, H] (replicated) or this rank's token chunk [T_r, H] with sequence parallelism."""
        if self.group is None:
            return _embedding(input_ids, self.weight)
        local = input_ids - self.start  # [T]
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = _embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp(rows, self.group, self.sequence_parallel)


def _embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """weight[ids]. Under autograd, for a weight with a `GradBuffers` main_grad, through `_Embedding` (the rows'
    gradients go into main_grad's rows); otherwise (inference, the rollout's compiled decode included) torch's."""
    if fills_main_grad(weight):
        return _Embedding.apply(ids, weight)
    return F.embedding(ids, weight)


class _Embedding(torch.autograd.Function):
    """rows = weight[ids], whose backward adds the rows' gradients into the weight's fp32 main_grad
    (`accumulate_embedding_grad`) instead of forming the dense vocabulary-sized gradient."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ids, weight = ctx.saved_tensors
        return None, accumulate_embedding_grad(weight, ids, grad) if ctx.needs_input_grad[1] else None


# fp32 elements of one token chunk's temporaries in the logprob maths ([C, V/tp] each, two alive at once): bounds
# memory for long packed micro batches (8192 tokens x 64k vocab columns would be 2 GiB per full-size temporary).
LOGPROB_CHUNK_ELEMENTS = 2**26


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, group: Group, vocab_size: int,
                            chunk_elements: int = LOGPROB_CHUNK_ELEMENTS) -> tuple[Tensor, Tensor]:
    """Log-probability of `targets` and entropy of softmax(logits), never gathering the vocab.

    logits [T, Vp/tp]: this rank's block of the (padded) vocab columns; targets [T] global token ids.
    Returns (logprobs [T], entropy [T]) in fp32, identical on every TP rank. Padded columns (id >= vocab_size)
    are excluded. Differentiable in both outputs. Two small collectives, no host reads; backward keeps only
    `logits` and recomputes the softmax. On CUDA one fused pass over the logits each way; elsewhere token chunks of
    `chunk_elements` at a time (a max, then one exp pass that sums exp and exp * logit).
    """
    return _VocabParallelLogProbs.apply(logits, targets, group, vocab_size, chunk_elements)


def real_columns(logits: Tensor, group: Group, vocab_size: int) -> tuple[Tensor, int]:
    """logits [T, Vp/tp] -> (this rank's real columns [T, V'/tp], the global id of its first column): the vocab
    padding is the tail of the last blocks."""
    num_local = logits.shape[1]
    start = group_rank(group) * num_local
    return logits[:, :min(max(vocab_size - start, 0), num_local)], start


def local_columns(ids: Tensor, start: int, num_valid: int) -> tuple[Tensor, Tensor]:
    """Global token ids [..., k] -> (their column in this rank's block, clamped into it [..., k]; whether this rank
    holds them [..., k])."""
    local = ids - start
    mine = (local >= 0) & (local < num_valid)
    return local.clamp(0, max(num_valid - 1, 0)), mine


def held_values(z: Tensor, index: Tensor, mine: Tensor) -> Tensor:
    """z's values at `index` [T, k] (fp32) where this rank holds the column (`mine`), else 0."""
    if not z.shape[1]:  # a rank of vocab padding only
        return torch.zeros(index.shape, dtype=torch.float32, device=z.device)
    return torch.where(mine, z.gather(-1, index).float(), 0.0)


def softmax_normaliser(z: Tensor, group: Group, chunk_elements: int,
                       held: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """z [T, V'/tp] this rank's real columns, `held` [T, E] fp32 values each held by one rank (0 on the others; None:
    E = 0) -> (log sum exp over the whole vocab [T], E_p[z] [T], `held` summed over TP [T, E]).

    Each rank's statistics are relative to its own max, rescaled to the global max after one MAX all-reduce; then one
    SUM all-reduce carries sum exp(z - max), sum exp(z - max) * z and `held`."""
    return combine_block_stats(*block_softmax_stats(z, chunk_elements), group, held)


def combine_block_stats(block_max: Tensor, block_sum_exp: Tensor, block_sum_exp_z: Tensor, group: Group,
                        held: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Each rank's `block_softmax_stats` of its vocab block [T] each (and `held` [T, E]) -> `softmax_normaliser`'s
    (log sum exp over the whole vocab, E_p[z], `held` summed over TP), the same on every rank of `group`."""
    z_max = block_max
    if group is not None:
        z_max = block_max.clone()
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    rescale = (block_max - z_max).exp()  # [T]; 0 on a rank with no real column
    extra = [] if held is None else [held]
    sums = torch.cat([block_sum_exp.unsqueeze(-1) * rescale.unsqueeze(-1),
                      block_sum_exp_z.unsqueeze(-1) * rescale.unsqueeze(-1), *extra], dim=-1)  # [T, 2 + E]
    if group is not None:
        dist.all_reduce(sums, group=group)
    sum_exp, sum_exp_z = sums[:, 0], sums[:, 1]  # [T] each
    return z_max + sum_exp.log(), sum_exp_z / sum_exp, sums[:, 2:]


def block_softmax_stats(z: Tensor, chunk_elements: int) -> tuple[Tensor, Tensor, Tensor]:
    """z [T, V'] (this rank's real vocab columns) -> (max, sum exp(z - max), sum exp(z - max) * z), each [T] fp32;
    max -inf and sums 0 when V' is 0. The one device switch of the forward: CUDA runs one fused pass
    (`vocab_kernels.py`), everything else token chunks of `chunk_elements` through torch, the reference."""
    if z.is_cuda:
        from shardrl.parallel.vocab_kernels import block_stats  # Triton: CUDA installs only

        return block_stats(z, z.shape[1])
    return softmax_stats_reference(z, chunk_elements)


def softmax_stats_reference(z: Tensor, chunk_elements: int) -> tuple[Tensor, Tensor, Tensor]:
    """`block_softmax_stats` in torch ops, on any device."""
    num_tokens, num_cols = z.shape
    z_max = z.new_full((num_tokens,), float("-inf"), dtype=torch.float32)  # [T]
    sums = z.new_zeros(2, num_tokens, dtype=torch.float32)  # [2, T]
    if num_cols:
        z_max = z.amax(dim=-1).float()  # exact in any dtype
        for lo, hi in token_chunks(num_tokens, num_cols, chunk_elements):
            exp = (z[lo:hi] - z_max[lo:hi, None]).exp_()  # [C, V'] fp32
            sums[0, lo:hi] = exp.sum(-1)
            sums[1, lo:hi] = exp.mul_(z[lo:hi]).sum(-1)
    return z_max, sums[0], sums[1]


def token_chunks(num_tokens: int, num_cols: int, chunk_elements: int) -> list[tuple[int, int]]:
    """Token ranges [lo, hi) of at most `chunk_elements` / `num_cols` tokens: one chunk's fp32 temporaries."""
    size = max(chunk_elements // max(num_cols, 1), 1)
    return [(lo, min(lo + size, num_tokens)) for lo in range(0, num_tokens, size)]


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, group: Group, vocab_size: int,
                chunk_elements: int) -> tuple[Tensor, Tensor]:
        z, start = real_columns(logits, group, vocab_size)  # [T, V'/tp] this rank's real columns
        index, mine = local_columns(targets.unsqueeze(-1), start, z.shape[1])  # [T, 1] each
        target_z = held_values(z, index, mine)  # [T, 1]
        log_norm, mean_z, target_z = softmax_normaliser(z, group, chunk_elements, target_z)
        target_z, mine = target_z.squeeze(-1), mine.squeeze(-1)  # [T] each
        ctx.save_for_backward(logits, log_norm, mean_z, index, mine)
        ctx.num_valid, ctx.chunk_elements = z.shape[1], chunk_elements
        ctx.set_materialize_grads(False)  # an unused output (entropy as a metric only) costs no backward work
        return target_z - log_norm, log_norm - mean_z

    @staticmethod
    def backward(ctx, grad_logprob: Tensor | None, grad_entropy: Tensor | None):
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None
        logits, log_norm, mean_z, index, mine = ctx.saved_tensors
        grad = block_logits_grad(logits, log_norm, mean_z, grad_logprob, grad_entropy, index, mine, ctx.num_valid,
                                 ctx.chunk_elements)
        return grad, None, None, None, None


def block_logits_grad(logits: Tensor, log_norm: Tensor, mean_z: Tensor, grad_logprob: Tensor | None,
                      grad_entropy: Tensor | None, index: Tensor, mine: Tensor, num_valid: int,
                      chunk_elements: int) -> Tensor:
    """Gradient [T, V/tp] (logits' dtype; 0 in padded columns) of grad_logprob * logp(target) + grad_entropy *
    entropy with respect to this rank's logits: d logp / dz = onehot - p, d entropy / dz = -p * (z - E_p[z]).
    The one device switch of the backward: CUDA runs one fused pass (`vocab_kernels.py`), everything else token
    chunks of `chunk_elements` through torch, the reference."""
    if logits.is_cuda:
        from shardrl.parallel.vocab_kernels import block_grad  # Triton: CUDA installs only

        local_target = torch.where(mine, index.squeeze(-1), -1).to(torch.int32)  # [T]
        return block_grad(logits, log_norm, mean_z, grad_logprob, grad_entropy, local_target, num_valid)
    return logits_grad_reference(logits, log_norm, mean_z, grad_logprob, grad_entropy, index, mine, num_valid,
                                 chunk_elements)


def logits_grad_reference(logits: Tensor, log_norm: Tensor, mean_z: Tensor, grad_logprob: Tensor | None,
                          grad_entropy: Tensor | None, index: Tensor, mine: Tensor, num_valid: int,
                          chunk_elements: int) -> Tensor:
    """`block_logits_grad` in torch ops, on any device."""
    grad = torch.zeros_like(logits) if num_valid < logits.shape[1] else torch.empty_like(logits)  # [T, V/tp]
    for lo, hi in token_chunks(logits.shape[0], num_valid, chunk_elements) if num_valid else []:
        z = logits[lo:hi, :num_valid]  # [C, V'/tp]
        probs = (z - log_norm[lo:hi, None]).exp_()  # [C, V'/tp] fp32
        if grad_entropy is None:
            g = probs.mul_(-grad_logprob[lo:hi, None])
        else:
            g = (z - mean_z[lo:hi, None]).mul_(grad_entropy[lo:hi, None])
            if grad_logprob is not None:
                g.add_(grad_logprob[lo:hi, None])
            g.mul_(probs).neg_()
        if grad_logprob is not None:
            g.scatter_add_(-1, index[lo:hi], torch.where(mine[lo:hi], grad_logprob[lo:hi], 0.0).unsqueeze(-1))
        grad[lo:hi, :num_valid] = g
    return grad


@torch.no_grad()
def vocab_parallel_sum_squared_probs(logits: Tensor, group: Group, vocab_size: int,
                                     chunk_elements: int = LOGPROB_CHUNK_ELEMENTS) -> Tensor:
    """logits [T, Vp/tp] (this rank's block) -> sum over the real vocabulary of softmax(logits)^2 [T] fp32, the same on
    every TP rank (the optimal token baseline's collision probability); token chunks of `chunk_elements`."""
    z, _ = real_columns(logits, group, vocab_size)  # [T, V'/tp]
    log_norm, _, _ = softmax_normaliser(z, group, chunk_elements)
    total = torch.zeros(z.shape[0], dtype=torch.float32, device=z.device)  # [T]
    for lo, hi in token_chunks(z.shape[0], z.shape[1], chunk_elements) if z.shape[1] else []:
        total[lo:hi] = (2.0 * (z[lo:hi] - log_norm[lo:hi, None])).exp_().sum(-1)
    if group is not None:
        dist.all_reduce(total, group=group)
    return total


@torch.no_grad()
def gather_vocab(logits: Tensor, group: Group, vocab_size: int) -> Tensor:
    """logits [T, Vp/tp] -> full [T, V] (no autograd; for sampling and tests, not for training losses)."""
    if group is not None:
        blocks = [torch.empty_like(logits) for _ in range(group_size(group))]
        dist.all_gather(blocks, logits.contiguous(), group=group)
        logits = torch.cat(blocks, dim=-1)
    return logits[..., :vocab_size]
