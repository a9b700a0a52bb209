"""Padded rollout batches <-> packed token streams for the trainer's models.

Rollout batches use verl's padded layout: ``input_ids [B, S]`` is the left-padded prompt (P tokens) followed by the
right-padded response (R tokens), ``S = P + R``, with ``attention_mask [B, S]`` and ``position_ids [B, S]``. The
models consume packed sequences without padding (``input_ids [T]``, ``cu_seqlens [N+1]``), so no compute is spent
on pad tokens. The logprob of ``responses[b, j]`` is read at the packed position of token ``P + j - 1`` (the
position that predicts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shardrl.parallel.context import ContextShard, gather_tokens, shard_micro_batch
from shardrl.parallel.layout import Layout


@dataclass
class Packed:
    input_ids: Tensor  # [T]
    position_ids: Tensor  # [T]
    cu_seqlens: Tensor  # [N+1] int32
    targets: Tensor  # [T] the next token of every position (garbage at each sequence's last token, never read)
    response_index: Tensor  # [B, R] packed position predicting responses[b, j] (0 where the response is padding)
    # With context parallelism: this CP rank's share. input_ids, position_ids and targets are then its tokens only
    # [T_r]; cu_seqlens and response_index still describe the whole micro batch.
    context: ContextShard | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> Packed:
        assert self.context is None, "a CP share is cut on its device"
        return Packed(*(t.to(device) for t in (self.input_ids, self.position_ids, self.cu_seqlens, self.targets,
                                               self.response_index)))

    def context_share(self, layout: Layout) -> Packed:
        """This CP rank's share of the micro batch (itself without context parallelism): see `parallel/context.py`."""
        if layout.cp_size == 1:
            return self
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        shard = shard_micro_batch(lengths, layout.rank("cp"), layout.cp_size, layout.group("cp"),
                                  self.input_ids.device)
        index = shard.local_index
        return Packed(self.input_ids[index], self.position_ids[index], self.cu_seqlens, self.targets[index],
                      self.response_index, shard)


def pack(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_length: int) -> Packed:
    """Drop padding from a padded batch (see the module docstring); the valid tokens of a row must be contiguous."""
    mask = attention_mask.bool()  # [B, S]
    lengths = mask.sum(-1)  # [B]
    if (lengths == 0).any():
        raise ValueError("pack: a row has no valid token (attention_mask all zero)")
    packed_pos = torch.cumsum(mask.flatten().long(), 0).view_as(mask) - 1  # [B, S] packed index of each token
    ids = input_ids[mask]  # [T]
    prompt_length = input_ids.shape[1] - response_length
    response_index = packed_pos[:, prompt_length - 1:-1].clamp_min(0)  # [B, R]
    cu_seqlens = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return Packed(ids, position_ids[mask], cu_seqlens, torch.roll(ids, -1), response_index)


def whole_micro_batch(per_token: Tensor, packed: Packed) -> Tensor:
    """Per-token values of this rank's tokens -> of all T tokens of the micro batch: gathered over CP when the
    micro batch is a CP share (what consumes them then runs alike on every CP rank), else as they are."""
    return per_token if packed.context is None else gather_tokens(per_token, packed.context, replicated=True)


def unpack_responses(per_token: Tensor, packed: Packed) -> Tensor:
    """[T] (or a CP share's [T_r]) values at packed positions -> [B, R] aligned with `responses` (differentiable
    gather)."""
    return whole_micro_batch(per_token, packed)[packed.response_index]


def pack_responses(per_response: Tensor, packed: Packed, response_mask: Tensor) -> Tensor:
    """[B, R, ...] values aligned with `responses` -> [T, ...] at the packed positions that predict them (this CP
    rank's tokens [T_r, ...] for a CP share), the inverse of `unpack_responses`; 0 at every other position."""
    total = packed.num_tokens if packed.context is None else sum(packed.context.counts)
    out = per_response.new_zeros(total, *per_response.shape[2:])
    valid = response_mask.bool()
    out[packed.response_index[valid]] = per_response[valid]
    return out if packed.context is None else out[packed.context.local_index]

