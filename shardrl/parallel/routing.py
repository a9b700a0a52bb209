"""MoE routing record and replay: the foundation of routing replay (R2/R3), where the trainer's MoE layers use the
experts another forward chose (the rollout engine's, or the old-logprob pass's) instead of their own top-k.

A `RoutingTable` holds the expert choices of one forward over packed tokens: `experts` [T, L, k], the global expert
ids of the T tokens a TP group holds (packed order) at each of the model's L MoE layers (`layer_ids`, in order).
Attached to a model's MoE layers (`expert.attached`), it is filled by them (`replay=False`: each rank writes its own
tokens' rows; `complete` sums the ranks' parts) or read by them (`replay=True`). A replayed layer still weighs the
replayed experts by its own router's probabilities, so the router's gradient flows and its losses are computed as
usual; only the choice of experts is taken from the table.

The largest value of the id type (`unknown_expert`, never an expert: `expert_id_dtype` keeps it free) marks a
token whose routing nobody recorded: the last sampled token of a rollout, which the engine never ran through the
model, or environment tokens appended after the last model turn. A replaying layer routes such a token (any id
past its experts) by its own top-k.

Each layer also counts the tokens whose own top-k (as a set) differs from the table's experts (`replay`) or from a
`reference` routing a recording pass is compared against (the rollout's, while the pass routes itself): the routing
mismatch between two forwards, per token summed over layers (`mismatch_per_token`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds every expert id with its largest value to spare (`unknown_expert`):
    how a batch stores routing."""
    if num_experts < 256:
        return torch.uint8
    return torch.int16 if num_experts < 2 ** 15 else torch.int32


def unknown_expert(dtype: torch.dtype) -> int:
    """The id that marks a token without recorded routing in a table of `dtype` (its largest value)."""
    return torch.iinfo(dtype).max


class RoutingTable:
    def __init__(self, experts: Tensor, layer_ids: Sequence[int], replay: bool,
                 reference: Tensor | None = None) -> None:
        """`experts` [T, L, k] expert ids (any integer type; used as int64 on its device), L = len(layer_ids).
        `reference` [T, L, k] (recording only): the routing to count this forward's choices against."""
        for name, table in (("experts", experts), ("reference", reference)):
            if table is not None and (table.dim() != 3 or table.shape[1] != len(layer_ids)):
                raise ValueError(f"RoutingTable: {name} of shape {tuple(table.shape)} for {len(layer_ids)} MoE "
                                 f"layers; expected [tokens, {len(layer_ids)}, top_k]")
        if replay and reference is not None:
            raise ValueError("RoutingTable: a replayed table is its own reference; give `reference` only to record")
        self.experts = experts.long()
        self.reference = None if reference is None else reference.long()
        self.column = {layer_id: i for i, layer_id in enumerate(layer_ids)}
        self.replay = replay
        # (layer, first token) -> [tokens, 2] (own choice differs, compared) of that layer's rows on this rank. Keyed,
        # not summed, so a forward recomputed for backward (activation checkpointing) counts once.
        self._mismatch: dict[tuple[int, int], Tensor] = {}

    @classmethod
    def recording(cls, num_tokens: int, layer_ids: Sequence[int], top_k: int, device: torch.device,
                  reference: Tensor | None = None) -> RoutingTable:
        """An empty table for a forward to record into (compared against `reference` when given)."""
        experts = torch.zeros(num_tokens, len(layer_ids), top_k, dtype=torch.long, device=device)
        return cls(experts, layer_ids, False, None if reference is None else reference.to(device))

    def context_share(self, local_index: Tensor) -> RoutingTable:
        """The table of one CP rank's share of the micro batch's tokens (`local_index` [T_r], packed positions in
        order): its rows of a replayed table, or a recording table of its tokens (compared against its rows of the
        reference). Its results are per local token; the caller gathers them back over CP."""
        layer_ids = sorted(self.column, key=self.column.__getitem__)
        if self.replay:
            return RoutingTable(self.experts[local_index], layer_ids, replay=True)
        reference = None if self.reference is None else self.reference[local_index]
        return RoutingTable.recording(local_index.numel(), layer_ids, self.experts.shape[-1], self.experts.device,
                                      reference)

    @property
    def counts_mismatch(self) -> bool:
        return self.replay or self.reference is not None

    def rows(self, layer_id: int, start: int, stop: int, table: Tensor | None = None) -> Tensor:
        """The expert ids [stop - start, k] of tokens start..stop at MoE layer `layer_id` in `experts` (or in
        `table`, e.g. the reference); a view: recording writes into it."""
        if layer_id not in self.column:
            raise KeyError(f"RoutingTable: MoE layer {layer_id} is not among its layers {sorted(self.column)}")
        table = self.experts if table is None else table
        if stop > table.shape[0]:
            raise ValueError(f"RoutingTable: tokens {start}..{stop} at layer {layer_id}, but it holds "
                             f"{table.shape[0]}; the table must cover the forward's packed tokens")
        return table[start:stop, self.column[layer_id]]

    def choose(self, layer_id: int, start: int, probs: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
        """One layer's choice for its tokens start..start+len(probs): (router probabilities [T, k], experts [T, k]).
        Replay: the table's experts (a token marked unknown keeps its own); record: its own top-k, written into
        the table. Either way the layer's own top-k is counted against the table's (or the reference's)."""
        stop = start + probs.shape[0]
        own_probs, own = torch.topk(probs, top_k, dim=-1)
        if self.replay:
            table = self.rows(layer_id, start, stop)
            known = self._count(layer_id, start, own, table, probs.shape[-1])
            chosen = torch.where(known[:, None], table, own)
            return probs.gather(-1, chosen), chosen
        self.rows(layer_id, start, stop).copy_(own)
        if self.reference is not None:
            self._count(layer_id, start, own, self.rows(layer_id, start, stop, self.reference), probs.shape[-1])
        return own_probs, own

    def _count(self, layer_id: int, start: int, own: Tensor, other: Tensor, num_experts: int) -> Tensor:
        """Record which tokens' own experts differ (as sets) from `other`'s; returns the tokens whose routing
        `other` knows ([T] bool: every id an expert, none `unknown_expert`)."""
        known = (other < num_experts).all(-1)
        differs = (own.sort(-1).values != other.sort(-1).values).any(-1) & known
        self._mismatch[(layer_id, start)] = torch.stack([differs, known], dim=1).long()  # [T, 2]
        return known

    def mismatch_per_token(self, groups: Sequence[dist.ProcessGroup | None]) -> Tensor:
        """[T, 2] per token, summed over the MoE layers: (layers whose own choice differed from the table's or the
        reference's, layers that compared), complete on every rank of `groups` (TP: each rank counted its tokens;
        PP: each stage its layers)."""
        total = torch.zeros(self.experts.shape[0], 2, dtype=torch.long, device=self.experts.device)
        for (_, start), counts in self._mismatch.items():
            total[start:start + counts.shape[0]] += counts
        for group in groups:
            if group is not None:
                dist.all_reduce(total, group=group)
        return total

    def complete(self, groups: Sequence[dist.ProcessGroup | None]) -> None:
        """After a recording forward: every rank of `groups` (its TP group, whose ranks each recorded their own
        tokens, and its PP group, whose stages each recorded their own layers) gets the whole table. Each entry was
        written by exactly one rank and is zero elsewhere, so a sum assembles it."""
        for group in groups:
            if group is not None:
                dist.all_reduce(self.experts, group=group)
