"""The engine's device side: the model, its KV cache and decode graphs, and the two forward passes.

`prefill_logits` runs whole sequences into their cache slots; `decode_logits` advances every running slot by one
token, through CUDA graphs on GPU (`cuda_graphs.py`) and through `decode_hidden`, the portable reference, elsewhere.
Both return full-vocabulary logits of the rows to sample, identical on every TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shardrl.models.config import ModelConfig
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import Layout
from shardrl.parallel.tensor import gather_vocab
from shardrl.rollout.cuda_graphs import DecodeGraphs, length_bucket
from shardrl.rollout.kv_cache import DecodeAttention, KVCache, PrefillAttention, gpu_cache_budget, num_slots_for_budget
from shardrl.rollout.request import Request, SamplingParams
from shardrl.rollout.sampler import SamplingBatch, sample
from shardrl.rollout.scheduler import Batch


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizes (verl's rollout key names). The KV cache gets what `gpu_memory_utilization` of the GPU leaves
    after everything in use at start-up and the activations of a full prefill; on CPU it holds
    `cpu_kv_cache_tokens` tokens. `enforce_eager` turns the CUDA-graph decode off."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_tokens: int = 65536
    dtype: torch.dtype = torch.float32
    enforce_eager: bool = False
    max_graph_rows: int = 512  # larger decode batches run eagerly
    seed: int = 0  # of the shared generator unseeded requests draw from (identical on every TP rank)
    eos_token_ids: tuple[int, ...] | None = None  # None: config.json's eos_token_id

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.max_num_batched_tokens < self.max_model_len:
            # Sequences are prefilled whole (also when resumed after an abort), so one must fit in a prefill batch.
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len="
                             f"{self.max_model_len}: a whole sequence is prefilled in one step")


class ModelRunner:
    def __init__(self, model_config: ModelConfig, layout: Layout, config: EngineConfig) -> None:
        self.model_config, self.layout, self.config, self.device = model_config, layout, config, layout.device
        self.model = Transformer(model_config, layout, dtype=config.dtype).eval().requires_grad_(False)
        self.cache = self._build_cache()
        self.graphs: DecodeGraphs | None = None
        self.offloaded = False

    def prefill_logits(self, requests: list[Request]) -> Tensor:
        """Run whole sequences (prompt plus tokens so far) into their cache slots -> next-token logits [N, V]."""
        sequences = [r.all_ids() for r in requests]
        lengths = [len(s) for s in sequences]
        host = torch.tensor([t for s in sequences for t in s] + [p for n in lengths for p in range(n)]
                            + [r.slot for r, n in zip(requests, lengths) for _ in range(n)] + lengths)
        ids, positions, slots, lengths_t = host.to(self.device, non_blocking=True).split(
            [sum(lengths)] * 3 + [len(lengths)])
        cu_seqlens = torch.nn.functional.pad(lengths_t.cumsum(0), (1, 0)).int()  # [N+1]
        hidden = self.model(ids, positions, cu_seqlens, PrefillAttention(self.cache, slots, positions), max(lengths))
        return self.logits(hidden[cu_seqlens[1:] - 1])

    def decode_logits(self, batch: Batch) -> Tensor:
        """One token for every slot 0..num_rows-1 (free slots ride along) -> logits [N, V] of the running ones."""
        ids, positions = [0] * batch.num_rows, [0] * batch.num_rows
        for r in batch.requests:
            ids[r.slot], positions[r.slot] = r.token_ids[-1], r.num_tokens - 1
        length = max(positions) + 1
        host = torch.tensor(ids + positions + [r.slot for r in batch.requests])
        ids_t, positions_t, active = host.to(self.device, non_blocking=True).split(
            [batch.num_rows, batch.num_rows, len(batch.requests)])
        if self._use_graphs(batch.num_rows):
            if self.graphs is None:
                self.graphs = DecodeGraphs(self.decode_hidden, min(self.cache.num_slots, self.config.max_graph_rows),
                                           self.cache.max_len, self.device)
            hidden = self.graphs.run(ids_t, positions_t, length)
        else:
            hidden = self.decode_hidden(ids_t, positions_t, length_bucket(length, self.cache.max_len))
        if len(batch.requests) < batch.num_rows:  # else every row is a running request, in slot order
            hidden = hidden.index_select(0, active)
        return self.logits(hidden)

    def decode_hidden(self, ids: Tensor, positions: Tensor, length: int) -> Tensor:
        """The portable decode forward (and what the CUDA graphs capture): ids, positions [B] -> hidden [B, H]."""
        cu_seqlens = torch.arange(ids.shape[0] + 1, dtype=torch.int32, device=ids.device)
        return self.model(ids, positions, cu_seqlens, DecodeAttention(self.cache, positions, length), 1)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, H] -> full-vocab logits [N, V] on every TP rank."""
        logits = self.model.compute_logits(hidden, hidden.shape[0])  # [N, Vp/tp]
        return gather_vocab(logits, self.layout.tp_group, self.model_config.vocab_size)

    def release_memory(self, offload_weights: bool) -> None:
        """Free the cache (and the graphs pointing into it); with `offload_weights` move weights to pinned host
        memory (a no-op on CPU)."""
        self.cache.free()
        self.graphs = None
        if offload_weights and self.device.type == "cuda":
            for param in self.model.parameters():
                param.data = torch.empty_like(param, device="cpu", pin_memory=True).copy_(param)
            self.offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore_memory(self, kv_cache: bool) -> None:
        if self.offloaded:
            for param in self.model.parameters():
                param.data = param.data.to(self.device, non_blocking=True)
            self.offloaded = False
        if kv_cache and self.cache.data is None:
            self.cache.allocate()

    def _use_graphs(self, num_rows: int) -> bool:
        """CUDA graphs need static shapes: MoE dispatch sizes depend on the routing, so MoE models decode eagerly."""
        return (self.device.type == "cuda" and not self.config.enforce_eager and self.model_config.moe is None
                and num_rows <= self.config.max_graph_rows)

    def _build_cache(self) -> KVCache:
        config, model = self.config, self.model_config
        kv_heads = max(model.num_kv_heads // self.layout.tp_size, 1)
        per_slot = KVCache.bytes_per_slot(model.num_layers, config.max_model_len, kv_heads, model.head_dim,
                                          config.dtype)
        if self.device.type == "cuda":
            budget = gpu_cache_budget(self.device, config.gpu_memory_utilization, self._activation_bytes())
            source = "gpu_memory_utilization"
        else:
            budget = config.cpu_kv_cache_tokens * per_slot // config.max_model_len
            source = "cpu_kv_cache_tokens"
        slots = num_slots_for_budget(budget, per_slot, config.max_num_seqs, source)
        return KVCache(model.num_layers, slots, config.max_model_len, kv_heads, model.head_dim, config.dtype,
                       self.device)

    @torch.inference_mode()
    def _activation_bytes(self) -> int:
        """Peak extra GPU memory of the largest step: a full prefill, its logits and sampling for max_num_seqs."""
        config = self.config
        tokens, rows = config.max_num_batched_tokens, min(config.max_num_seqs, config.max_num_batched_tokens)
        longest = min(tokens, config.max_model_len)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(tokens, device=self.device) % longest
        cu_seqlens = torch.tensor([*range(0, tokens, longest), tokens], dtype=torch.int32, device=self.device)
        logits = self.logits(self.model(ids, positions, cu_seqlens)[:rows])
        params = [SamplingParams(top_p=0.9)] * rows  # the sort makes this the costliest sampling path
        sample(logits, SamplingBatch.build(params, [None] * rows, self.model_config.vocab_size, self.device))
        del logits
        return torch.cuda.max_memory_allocated(self.device) - base
