"""MoE routing record and replay: the foundation of routing replay (R2/R3), where the trainer's MoE layers use the
experts another forward chose (the rollout engine's, or the old-logprob pass's) instead of their own top-k.

A `RoutingTable` holds the expert choices of one forward over packed tokens: `experts` [T, L, k], the global expert
ids of the T tokens a TP group holds (packed order) at each of the model's L MoE layers (`layer_ids`, in order).
Attached to a model's MoE layers (`expert.attached`), it is filled by them (`replay=False`: each rank writes its own
tokens' rows; `complete` sums the ranks' parts) or read by them (`replay=True`). A replayed layer still weighs the
replayed experts by its own router's probabilities, so the router's gradient flows and its losses are computed as
usual; only the choice of experts is taken from the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds every expert id (how a batch stores routing)."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2 ** 15 else torch.int32


class RoutingTable:
    def __init__(self, experts: Tensor, layer_ids: Sequence[int], replay: bool) -> None:
        """`experts` [T, L, k] expert ids (any integer type; used as int64 on its device), L = len(layer_ids)."""
        if experts.dim() != 3 or experts.shape[1] != len(layer_ids):
            raise ValueError(f"RoutingTable: experts of shape {tuple(experts.shape)} for {len(layer_ids)} MoE layers; "
                             f"expected [tokens, {len(layer_ids)}, top_k]")
        self.experts = experts.long()
        self.column = {layer_id: i for i, layer_id in enumerate(layer_ids)}
        self.replay = replay

    @classmethod
    def recording(cls, num_tokens: int, layer_ids: Sequence[int], top_k: int, device: torch.device) -> RoutingTable:
        """An empty table for a forward to record into."""
        return cls(torch.zeros(num_tokens, len(layer_ids), top_k, dtype=torch.long, device=device), layer_ids, False)

    def rows(self, layer_id: int, start: int, stop: int) -> Tensor:
        """The expert ids [stop - start, k] of tokens start..stop at MoE layer `layer_id` (a view: recording writes
        into it)."""
        if layer_id not in self.column:
            raise KeyError(f"RoutingTable: MoE layer {layer_id} is not among its layers {sorted(self.column)}")
        if stop > self.experts.shape[0]:
            raise ValueError(f"RoutingTable: tokens {start}..{stop} at layer {layer_id}, but it holds "
                             f"{self.experts.shape[0]}; the table must cover the forward's packed tokens")
        return self.experts[start:stop, self.column[layer_id]]

    def complete(self, groups: Sequence[dist.ProcessGroup | None]) -> None:
        """After a recording forward: every rank of `groups` (its TP group, whose ranks each recorded their own
        tokens, and its PP group, whose stages each recorded their own layers) gets the whole table. Each entry was
        written by exactly one rank and is zero elsewhere, so a sum assembles it."""
        for group in groups:
            if group is not None:
                dist.all_reduce(self.experts, group=group)
