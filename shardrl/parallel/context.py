"""Context parallelism: each CP rank of a data-parallel replica holds a share of every packed micro batch's tokens.

Sharding. Every sequence of the micro batch is cut into `2 * CP` chunks as equal as its length allows; CP rank r
takes chunks r and 2*CP-1-r. Causal attention work grows along a sequence, so an early chunk paired with a late one
gives every rank about the same work (Megatron's load balancing). A sequence shorter than 2*CP tokens leaves some
ranks empty chunks; a rank may hold no token of a micro batch at all. Chunks keep the packed order, so a rank's
share is `local_index` [T_r] into the micro batch's T tokens.

Attention. K and V of the whole micro batch are all-gathered over CP (`gather_tokens(..., replicated=False)`: the
backward sums each rank's gradients of them and keeps its own tokens' rows); this rank's queries attend over them
with the causal mask of their global packed positions. The all-gather was chosen over a ring of K/V blocks for its
simplicity and because the sequences RL trains on fit a gathered K/V per layer (recomputed in backward under
activation checkpointing); a ring would only pay off once a gathered layer's K/V no longer fits.

Outputs. Per-token results (log-probs, entropies, values) are all-gathered into the micro batch's full order
(`replicated=True`) so the loss runs unchanged, identically on every CP rank; its backward keeps each rank's own
tokens' gradients, and the dense gradients are then summed over DP x CP (`dp_cp`) as usual, which adds the CP
ranks' token shares. Counts and metrics are summed over DP only: CP ranks hold the same rows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from shardrl.parallel.collectives import all_gather_single


@dataclass(frozen=True)
class ContextShard:
    """This CP rank's share of one packed micro batch, and what attention needs to read it."""

    local_index: Tensor  # [T_r] int64: the micro batch's packed positions this rank holds, in order
    rank_order: Tensor  # [T] int64: where each packed position is in the concatenation of the ranks' shares
    gathered_rows: Tensor  # [T] int64: the real rows of the padded all-gather, rank after rank
    counts: tuple[int, ...]  # tokens each CP rank holds (the all-gathers' sizes)
    group: dist.ProcessGroup
    # Per chunk this rank holds (empty ones left out), as a varlen attention kernel reads them: its queries are
    # rows cu_q[i]:cu_q[i+1] of this rank's tokens; its keys, the prefix of its sequence up to the chunk's end, are
    # rows cu_k[i]:cu_k[i+1] of the whole micro batch's keys taken at `key_index`.
    key_index: Tensor  # [K] int64
    cu_q: Tensor  # [C+1] int32
    cu_k: Tensor  # [C+1] int32
    max_q: int
    max_k: int


def chunk_bounds(length: int, num_chunks: int) -> list[int]:
    """Boundaries of `num_chunks` near-equal chunks of a sequence of `length` tokens ([num_chunks + 1])."""
    return [length * j // num_chunks for j in range(num_chunks + 1)]


def shard_chunks(seq_lengths: list[int], rank: int, size: int) -> list[tuple[int, int, int]]:
    """The chunks CP rank `rank` of `size` holds, in packed order: (start, end, start of its sequence) as packed
    positions, for chunks `rank` and `2*size-1-rank` of every sequence, empty ones left out."""
    chunks, start = [], 0
    for length in seq_lengths:
        bounds = chunk_bounds(length, 2 * size)
        for chunk in (rank, 2 * size - 1 - rank):
            if bounds[chunk + 1] > bounds[chunk]:
                chunks.append((start + bounds[chunk], start + bounds[chunk + 1], start))
        start += length
    return chunks


def shard_positions(seq_lengths: list[int], rank: int, size: int) -> list[int]:
    """The packed positions CP rank `rank` of `size` holds (`shard_chunks`' chunks, token by token)."""
    return [p for begin, end, _ in shard_chunks(seq_lengths, rank, size) for p in range(begin, end)]


def shard_micro_batch(seq_lengths: list[int], rank: int, size: int, group: dist.ProcessGroup,
                      device: torch.device) -> ContextShard:
    """This rank's `ContextShard` of a micro batch of sequences `seq_lengths` (host ints, so no device read)."""
    shares = [shard_positions(seq_lengths, r, size) for r in range(size)]
    num_tokens = sum(seq_lengths)
    order = torch.empty(num_tokens, dtype=torch.long)
    order[torch.tensor([p for s in shares for p in s], dtype=torch.long)] = torch.arange(num_tokens)
    chunks = shard_chunks(seq_lengths, rank, size)
    q_lens = [end - begin for begin, end, _ in chunks]
    k_lens = [end - seq_start for _, end, seq_start in chunks]
    key_index = [p for _, end, seq_start in chunks for p in range(seq_start, end)]

    def cumulative(lengths: list[int]) -> Tensor:
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

    counts, most = [len(share) for share in shares], max(len(share) for share in shares)
    gathered_rows = torch.tensor([r * most + i for r, n in enumerate(counts) for i in range(n)], dtype=torch.long,
                                 device=device)
    return ContextShard(torch.tensor(shares[rank], dtype=torch.long, device=device), order.to(device), gathered_rows,
                        tuple(counts), group, torch.tensor(key_index, dtype=torch.long, device=device),
                        cumulative(q_lens), cumulative(k_lens), max(q_lens, default=0), max(k_lens, default=0))


def gather_tokens(local: Tensor, shard: ContextShard, replicated: bool) -> Tensor:
    """[T_r, ...] this rank's rows -> [T, ...] every rank's, in the micro batch's packed order (differentiable).

    `replicated`: what consumes the result runs identically on every CP rank (the loss), so the gradient of this
    rank's rows is its own copy's; else (K and V, used by this rank's queries only) the copies' gradients are
    summed over CP first."""
    return _GatherTokens.apply(local, shard, replicated)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, shard: ContextShard, replicated: bool) -> Tensor:
        ctx.shard, ctx.replicated = shard, replicated
        most = max(shard.counts)
        padded = local.new_zeros(most, *local.shape[1:])  # gloo gathers equal sizes only
        padded[:local.shape[0]] = local
        gathered = local.new_empty(len(shard.counts) * most, *local.shape[1:])
        all_gather_single(gathered, padded, group=shard.group)
        return gathered[shard.gathered_rows][shard.rank_order]

    @staticmethod
    def backward(ctx, grad: Tensor):
        shard = ctx.shard
        if not ctx.replicated:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=shard.group)
        return grad[shard.local_index], None, None


def context_attention_mask(cu_seqlens: Tensor, local_index: Tensor) -> Tensor:
    """[T_r, T] bool: query i (packed position local_index[i]) sees key j of its own sequence with j <= its
    position."""
    num_tokens = int(cu_seqlens[-1])
    keys = torch.arange(num_tokens, device=local_index.device)
    bounds = cu_seqlens[1:].to(keys.dtype)
    key_seq = torch.searchsorted(bounds, keys, right=True)  # [T]
    query_seq = torch.searchsorted(bounds, local_index, right=True)  # [T_r]
    return (query_seq[:, None] == key_seq[None, :]) & (keys[None, :] <= local_index[:, None])
