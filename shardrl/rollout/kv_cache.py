"""Per-slot KV cache and the two attention hooks (prefill, decode) the model calls through `PackedSeqs.kv_cache`.

Layout (the design choice): the cache has `num_slots` rows; a running sequence owns one row and keeps the keys and
values of its positions 0..max_model_len-1 there, per layer `[num_slots, max_model_len, kv_heads/tp, head_dim]`.
Compared with paged blocks this wastes the unused tail of each row, but decode attention then needs no gather and
no gather: decode row b *is* slot b (the scheduler hands out the lowest free slot, keeping running sequences packed
at the front). On CUDA in bf16/fp16 decode attention is a split-KV kernel (`decode_attention.py`) that reads each
row's own `position + 1` tokens, so a batch mixing long and short sequences (the async rollouter's steady state)
pays for the tokens it holds, not for the longest row times the rows. Elsewhere the reference reads the view
`cache[:B, :L]` under a mask. Slot count comes from a byte budget:
`gpu_memory_utilization` on GPU, a token budget on CPU (see `num_slots_for_budget`).

A fresh or restarted sequence is prefilled whole (prompt plus any tokens generated before an abort): its prefill
attention is the model's own packed attention, and the hook only stores k and v. A multi-turn continuation keeps
its slot between turns and prefills only its new tokens, which attend to the cached prefix too
(`CachedPrefixAttention`).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from shardrl.errors import UserError
from shardrl.models.attention import PackedSeqs, bitwise_attention, packed_attention


class KVCacheError(UserError, RuntimeError):
    """The cache does not fit; the message names the setting to change."""


class KVCache:
    """Keys and values of every layer for `num_slots` sequences of up to `max_len` tokens.

    Each layer's keys and values are tensors of their own, not views of one: a compiled decode forward
    (`EngineConfig.compile_decode`) then writes the new tokens in place, where a write into a view of a larger
    tensor would make it copy that whole tensor back every step.

    With `routing` = (MoE layers, top-k, id dtype) it also keeps every position's experts, `routing_ids`
    [S, max_len, L, k] (routing replay, R3): written where the keys and values of the same (slot, position) are,
    by the same forwards, so it holds exactly the routing that computed the cached keys and values, at a few bytes
    per token and layer beside the cache's kilobytes.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 routing: tuple[int, int, torch.dtype] | None = None) -> None:
        self.num_layers, self.shape = num_layers, (num_slots, max_len, num_kv_heads, head_dim)
        self.num_slots, self.max_len, self.dtype, self.device = num_slots, max_len, dtype, device
        self.routing = routing
        self.layers: list[tuple[Tensor, Tensor]] | None = None
        self.routing_ids: Tensor | None = None
        self.allocate()

    @staticmethod
    def bytes_per_slot(num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       routing: tuple[int, int, torch.dtype] | None = None) -> int:
        routing_bytes = 0 if routing is None else routing[0] * routing[1] * max_len * routing[2].itemsize
        return num_layers * 2 * num_kv_heads * max_len * head_dim * dtype.itemsize + routing_bytes

    @property
    def allocated(self) -> bool:
        return self.layers is not None

    @property
    def nbytes(self) -> int:
        if not self.allocated:
            return 0
        routing = 0 if self.routing_ids is None else self.routing_ids.nbytes
        return sum(t.nbytes for pair in self.layers for t in pair) + routing

    def allocate(self) -> None:
        # Zeros, not empty: unwritten positions are masked, but masked NaN garbage would still poison softmax rows.
        self.layers = [tuple(torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(2))
                       for _ in range(self.num_layers)]
        if self.routing is not None:
            moe_layers, top_k, id_dtype = self.routing
            self.routing_ids = torch.zeros(self.num_slots, self.max_len, moe_layers, top_k, dtype=id_dtype,
                                           device=self.device)

    def free(self) -> None:
        self.layers = None
        self.routing_ids = None

    def copy_rows(self, sources: list[int], destinations: list[int], length: int) -> None:
        """Copy positions 0..length-1 of slot sources[i] into slot destinations[i], in every layer (a sequence that
        shares another's prefill; a parked prefix into or out of a spare row). Positions a shorter source never
        wrote copy stale values, which no one reads: a
        row attends only to the positions its own sequence wrote."""
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(destinations, device=self.device)
        for keys, values in self.layers:
            keys[dst, :length] = keys[src, :length]
            values[dst, :length] = values[src, :length]
        if self.routing_ids is not None:
            self.routing_ids[dst, :length] = self.routing_ids[src, :length]

    def layer(self, layer_id: int) -> tuple[Tensor, Tensor]:
        """(keys, values) of one layer, each [S, L, nkv, D]."""
        return self.layers[layer_id]


def num_slots_for_budget(budget_bytes: int, bytes_per_slot: int, max_num_seqs: int, source: str) -> int:
    """How many sequences the cache can hold (at most `max_num_seqs`); `source` names the budget's setting."""
    slots = min(max_num_seqs, budget_bytes // bytes_per_slot)
    if slots < 1:
        raise KVCacheError(f"{source}: the KV cache budget of {budget_bytes / 2**20:.1f} MiB does not hold one "
                           f"sequence of max_model_len tokens ({bytes_per_slot / 2**20:.1f} MiB); raise {source} or "
                           f"lower max_model_len")
    return slots


def gpu_cache_budget(device: torch.device, gpu_memory_utilization: float, reserve_bytes: int) -> int:
    """Bytes left for the cache when everything on the device may use `gpu_memory_utilization` of it, after what is
    in use now (weights, other processes) and `reserve_bytes` for activations."""
    free, total = torch.cuda.mem_get_info(device)
    return int(gpu_memory_utilization * total) - (total - free) - reserve_bytes


class PrefillAttention:
    """Hook for a prefill forward: store each token's k and v at (its slot, its position); attend as usual
    (`bitwise`: with the batch-invariant kernel, as the trainer does in bitwise mode)."""

    def __init__(self, cache: KVCache, slots: Tensor, positions: Tensor, bitwise: bool = False) -> None:
        self.cache, self.slots, self.positions, self.bitwise = cache, slots, positions, bitwise  # [T] each

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, seqs: PackedSeqs, scale: float) -> Tensor:
        keys, values = self.cache.layer(layer_id)
        keys[self.slots, self.positions] = k  # k [T, nkv, D]
        values[self.slots, self.positions] = v
        return packed_attention(q, k, v, seqs, scale, self.bitwise)


def _slot_rows(keys: Tensor) -> Tensor:
    """A layer's cache [S, L, nkv, D] as one key store [S * L, nkv, D]: slot s's position p is row s * L + p."""
    return keys.view(-1, *keys.shape[2:])


class CachedPrefixAttention:
    """Hook for a prefill of continuations: sequence b's new tokens sit at positions `starts[b]`..`starts[b] +
    new_lengths[b] - 1` of slot `seq_slots[b]`, whose positions before `starts[b]` already hold the prefix. Each
    token's k and v are stored, then its query attends causally to its slot's positions 0..its own.

    On CUDA in half precision the keys of every sequence (prefix and new tokens) are gathered from the cache into
    one packed run and the queries attend through flash attention's variable-length kernel, whose causal mask is
    aligned to the end of each sequence's keys (query i of n new ones sees keys 0..start + i). Elsewhere the
    queries are padded into a [B, Q] block against a [B, L] block of keys under an explicit mask (one SDPA call per
    layer): the reference the GPU path is checked against (`bench/continuation_check.py`). With `bitwise` (CUDA in
    half precision) the queries attend straight to their slots through the batch-invariant kernel."""

    def __init__(self, cache: KVCache, slots: Tensor, positions: Tensor, seq_slots: list[int], starts: list[int],
                 new_lengths: list[int], bitwise: bool = False) -> None:
        self.cache, self.slots, self.positions = cache, slots, positions  # [T] each
        device = positions.device
        ends = [s + n for s, n in zip(starts, new_lengths)]
        self.max_new, self.max_len = max(new_lengths), max(ends)
        self.flash = uses_split_kv_decode(cache.device, cache.dtype)
        self.bitwise = bitwise and self.flash
        if self.bitwise:  # per sequence: first query row, query count, first position, first cache row
            first_rows = [0, *itertools.accumulate(new_lengths)][:-1]
            host = torch.tensor([first_rows, new_lengths, starts, [s * cache.max_len for s in seq_slots]],
                                dtype=torch.int32)
            self.q_start, self.q_len, self.q_pos, self.k_start = host.to(device, non_blocking=True)
            return
        if self.flash:  # every sequence's keys 0..end-1, packed in sequence order
            self.key_slots = torch.tensor([slot for slot, e in zip(seq_slots, ends) for _ in range(e)], device=device)
            self.key_positions = torch.tensor([p for e in ends for p in range(e)], device=device)
            self.cu_queries = torch.tensor([0, *new_lengths], device=device).cumsum(0).int()
            self.cu_keys = torch.tensor([0, *ends], device=device).cumsum(0).int()
            return
        # token t of the packed batch -> its row in the padded [B * Q] query block
        self.query_rows = torch.tensor([b * self.max_new + i for b, n in enumerate(new_lengths) for i in range(n)],
                                       device=device)
        self.seq_slots = torch.tensor(seq_slots, device=device)
        query_pos = torch.tensor(starts, device=device)[:, None] + torch.arange(self.max_new, device=device)  # [B, Q]
        visible = torch.arange(self.max_len, device=device)[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
        self.mask = visible[:, None]  # [B, 1, Q, L]; a padding query still sees key 0, so no row is all -inf

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, seqs: PackedSeqs, scale: float) -> Tensor:
        keys, values = self.cache.layer(layer_id)
        keys[self.slots, self.positions] = k  # k [T, nkv, D]
        values[self.slots, self.positions] = v
        if self.bitwise:
            return bitwise_attention(q, _slot_rows(keys), _slot_rows(values), self.q_start, self.q_len, self.q_pos,
                                     self.k_start, self.max_new, scale)
        if self.flash:
            packed_k = keys[self.key_slots, self.key_positions]  # [sum of ends, nkv, D]
            packed_v = values[self.key_slots, self.key_positions]
            return torch.ops.aten._flash_attention_forward(
                q, packed_k, packed_v, self.cu_queries, self.cu_keys, self.max_new, self.max_len, 0.0, True, False,
                scale=scale)[0]
        num_seqs, (_, num_heads, head_dim) = self.seq_slots.shape[0], q.shape
        padded = q.new_zeros(num_seqs * self.max_new, num_heads, head_dim)
        padded[self.query_rows] = q
        queries = padded.view(num_seqs, self.max_new, num_heads, head_dim).transpose(1, 2)  # [B, nq, Q, D]
        group = num_heads // keys.shape[2]
        prefix_k = keys[self.seq_slots, :self.max_len].transpose(1, 2).repeat_interleave(group, dim=1)  # [B,nq,L,D]
        prefix_v = values[self.seq_slots, :self.max_len].transpose(1, 2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(queries, prefix_k, prefix_v, attn_mask=self.mask, scale=scale)
        return out.transpose(1, 2).reshape(num_seqs * self.max_new, num_heads, head_dim)[self.query_rows]


class DecodeAttention:
    """Hook for a decode forward over slots 0..B-1 (one new token each, at `positions[b]`), attending to the first
    `length` cache positions at most (each row to its positions 0..positions[b]). Only tensor ops with static
    shapes: the forward can be captured in a CUDA graph. With `bitwise` (CUDA in half precision) each row's query
    runs through the batch-invariant kernel, the one the trainer's attention runs in bitwise mode."""

    def __init__(self, cache: KVCache, positions: Tensor, length: int, bitwise: bool = False) -> None:
        self.cache, self.positions, self.length = cache, positions, length  # positions [B]
        num_rows, device = positions.shape[0], positions.device
        self.rows = torch.arange(num_rows, device=device)
        self.split_kv = uses_split_kv_decode(cache.device, cache.dtype)
        self.bitwise = bitwise and self.split_kv
        if self.bitwise:  # row b: query b, one of it, at positions[b], slot b's cache rows
            self.q_start = self.rows.to(torch.int32)
            self.one, self.q_pos = torch.ones_like(self.q_start), positions.to(torch.int32)
            self.k_start = self.q_start * cache.max_len
        elif self.split_kv:  # row b attends to its positions[b] + 1 cached tokens; built once per forward, not per layer
            self.used = (positions + 1).to(torch.int32)
        else:  # additive mask built once per forward, in the cache dtype, so no layer converts a boolean one again
            valid = torch.arange(length, device=device).unsqueeze(0) <= positions.unsqueeze(1)  # [B, L]
            self.mask = torch.zeros(valid.shape, dtype=cache.dtype, device=device).masked_fill_(~valid, -torch.inf)

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, seqs: PackedSeqs, scale: float) -> Tensor:
        keys, values = self.cache.layer(layer_id)  # [S, L, nkv, D]
        keys[self.rows, self.positions] = k  # k [B, nkv, D]
        values[self.rows, self.positions] = v
        if self.bitwise:
            return bitwise_attention(q, _slot_rows(keys), _slot_rows(values), self.q_start, self.one, self.q_pos,
                                     self.k_start, 1, scale)
        if self.split_kv:
            from shardrl.rollout.decode_attention import split_kv_decode_attention  # Triton: CUDA installs only

            return split_kv_decode_attention(q, keys, values, self.used, self.length, scale)
        num_rows = self.rows.shape[0]
        return reference_decode_attention(q, keys[:num_rows, :self.length].transpose(1, 2),
                                          values[:num_rows, :self.length].transpose(1, 2), self.mask, scale)


def uses_split_kv_decode(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention runs the split-KV kernel: CUDA in half precision (fp32 takes the reference)."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def reference_decode_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Portable decode attention through SDPA: q [B, nq, D], keys/values [B, nkv, L, D] (views of the cache are
    fine), mask [B, L] 0.0 where a key may be attended to and -inf elsewhere (or True/False) -> [B, nq, D].

    The query heads sharing a KV head are stacked as that head's query rows ([B, nkv, nq/nkv, D]), so grouped-query
    attention needs no copies of the cache.
    """
    num_rows, num_heads, head_dim = q.shape
    grouped = q.view(num_rows, keys.shape[1], -1, head_dim)  # [B, nkv, nq/nkv, D]
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num_rows, num_heads, head_dim)
