"""The engine's device side: the model, its KV cache and decode graphs, the two forward passes, decode sampling.

`prefill_logits` runs whole sequences into their cache slots (identical ones once) and returns full-vocabulary
logits (identical on every TP rank) for the engine to sample. `decode` advances slots 0..num_rows-1 by one token,
keeping the step's inputs on the device: each row's token and position live in fixed buffers, which the host
writes only when the batch changes (`load_decode_inputs`); every step samples the next token of each row, writes it
back as the next step's input and moves live rows one position on, so consecutive steps need nothing from the host. On GPU a whole step (forward,
sampling, update) is one CUDA-graph replay (`cuda_graphs.py`); eagerly the same functions run as they are.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from shardrl.models.config import ModelConfig
from shardrl.models.fast_paths import FastPaths
from shardrl.models.transformer import Transformer
from shardrl.parallel.expert import attached
from shardrl.parallel.layout import Layout
from shardrl.parallel.routing import RoutingTable, expert_id_dtype, unknown_expert
from shardrl.parallel.lora import LoRASettings, adapted_weights, adapter_modules, attach_lora
from shardrl.parallel.tensor import pack_adjacent, unpack
from shardrl.parallel.vocab import gather_vocab
from shardrl.rollout.cuda_graphs import DecodeGraphs, length_bucket, row_buckets
from shardrl.rollout.kv_cache import (
    CachedPrefixAttention,
    DecodeAttention,
    KVCache,
    PrefillAttention,
    gpu_cache_budget,
    num_slots_for_budget,
    uses_split_kv_decode,
)
from shardrl.rollout.request import Request, SamplingParams
from shardrl.rollout.sampler import SamplingBatch, SamplingBuffers, sample


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
    # torch.compile the decode forward before its CUDA graphs are captured. It fuses the many small elementwise
    # kernels of a step (494M Qwen2 shape, 256 rows on an H200: 4.25 -> 3.06 ms/step), but compiles once per new
    # rows bucket (in fp32 per (rows, length) bucket), tens of seconds each, and past torch's recompile limit (8)
    # new buckets run the plain forward: worth it for long runs of few bucket shapes, hence off by default.
    compile_decode: bool = False
    # Larger decode batches run eagerly: host-bound, 4.97x slower per step at 1,024 rows (1.67x with compile_decode;
    # 494M Qwen2 shape on an H200). 1,024 covers verl's default max_num_seqs; a graph's buffers grow with its rows
    # (logits over the vocabulary).
    max_graph_rows: int = 1024
    # Identical sequences in one prefill step (the n samples of a prompt) are run through the model once and their
    # keys and values copied to the others' cache rows (verl's `enable_prefix_caching`, narrowed to whole sequences
    # prefilled together: no cache outlives its request).
    share_prefill: bool = True
    # A multi-turn continuation of at most this many new tokens that arrives while others decode joins the decode
    # batch and feeds them one per step instead of stalling the batch for a prefill (see `scheduler.py`); 0: never.
    max_fed_tokens: int = 32
    # Multi-turn: cache rows the budget holds beyond `max_num_seqs` keep the prefixes of trajectories waiting on a
    # tool whose decode slot was lent to another sequence, so their next turn prefills its new tokens only (see
    # `scheduler.py`). Off, the cache holds at most `max_num_seqs` rows and a lent slot's prefix is dropped.
    spare_cache_rows: bool = False
    # Record every token's MoE experts (`RequestOutput.routed_experts`) for routing replay (R3): verl's
    # `enable_rollout_routing_replay`.
    record_routing: bool = False
    # Batch-invariant kernels (`FastPaths.bitwise`) in every forward and the trainer's logprob maths in sampling, so
    # a token's reported logprob is bit for bit the trainer's in bitwise mode (`rollout.bitwise_logprobs`).
    bitwise: bool = False
    # LoRA adapters on the targeted linears, as the actor's (`model.lora_rank`): weight sync writes them beside the
    # base weights and the engine folds them into its weights after each update (`ModelRunner.fold_adapters`),
    # which decodes as fast as a model without adapters; measured against applying them in the forward (~1.4x the
    # decode tokens/s for a 54-122 ms fold per sync, docs/lora.md). `lora_runtime`: apply them in the forward
    # instead (the trainer's own arithmetic, no pristine copy; the reference the folded path is tested against).
    lora: LoRASettings | None = None
    lora_runtime: bool = False
    # Sample unfiltered batches on CUDA with the fused Triton kernels (`sample_kernel.py`: one read of the logits
    # instead of five passes over [rows, vocab]); off: the portable torch ops, the reference they are tested against.
    fused_sampling: bool = True
    seed: int = 0  # of the shared generator unseeded requests draw from (identical on every TP rank)
    eos_token_ids: tuple[int, ...] | None = None  # None: config.json's eos_token_id
    # What every request's `logprobs` report, engine-wide as vLLM's `logprobs_mode` (verl's rollout key): a token's
    # logprob under the distribution it was drawn from (`processed_logprobs`: temperature, top-k, top-p applied) or
    # under the model's own temperature-1 unfiltered softmax (`raw_logprobs`).
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.max_num_batched_tokens < self.max_model_len:
            # Sequences are prefilled whole (also when resumed after an abort), so one must fit in a prefill batch.
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len="
                             f"{self.max_model_len}: a whole sequence is prefilled in one step")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: expected processed_logprobs or raw_logprobs")


class ModelRunner:
    def __init__(self, model_config: ModelConfig, layout: Layout, config: EngineConfig) -> None:
        self.model_config, self.layout, self.config, self.device = model_config, layout, config, layout.device
        self.model = Transformer(model_config, layout, dtype=config.dtype, fast=FastPaths(bitwise=config.bitwise))
        if config.lora is not None:  # before any load: checkpoint loads leave adapters alone, syncs fill them
            attach_lora(self.model, config.lora, layout)
        # Folded adapters: id(adapted weight) -> (A, B, scale), and a pristine host copy of each such base weight
        # (a bf16 merge cannot be undone exactly, so every fold starts from it).
        self._folds = {} if config.lora is None or config.lora_runtime else adapted_weights([self.model])
        self._pristine: dict[int, Tensor] = {}
        for adapter in adapter_modules([self.model]) if self._folds else ():
            adapter.enabled = False  # folded into the weights instead
        self.model.eval().requires_grad_(False)
        # Routing replay (R3): the MoE layers' ids and top-k when the runner records routing, else None.
        self.routing_layers = sorted(model_config.moe.layers) if config.record_routing else None
        self._pack_projections()
        self._reads_host = self.model.reads_host()  # fixed by the layout and dtype, asked once
        self.cache = self._build_cache()
        # Decode slots: cache rows 0..num_decode_slots-1; rows after them are spare (`EngineConfig.spare_cache_rows`).
        self.num_decode_slots = num_slots = min(self.cache.num_slots, config.max_num_seqs)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)  # unseeded rows' shared stream
        # Next decode step's inputs per slot: token [0], position [1], 1 if a request runs there else 0 [2].
        self.inputs = torch.zeros(3, num_slots, dtype=torch.long, device=self.device)
        self.ids, self.positions, self.live = self.inputs
        self.sampling = SamplingBuffers(num_slots, model_config.vocab_size, self.device)
        self.out = torch.zeros(num_slots, 3, dtype=torch.float64, device=self.device)  # a step's rows, see `decode`
        # A decode step's routing record (a fixed buffer, as CUDA graphs need): rows' experts [S, L, k].
        self._decode_routing = (None if self.routing_layers is None else torch.zeros(
            num_slots, len(self.routing_layers), model_config.moe.top_k, dtype=torch.long, device=self.device))
        self.graphs: DecodeGraphs | None = None
        self._split_kv = uses_split_kv_decode(self.device, config.dtype)
        self.graph_captures, self.graph_capture_seconds = 0, 0.0  # since the runner was built
        self.offloaded = False
        if config.compile_decode:  # the decode graphs, captured later, then record the compiled kernels
            self._decode_logits = torch.compile(self._decode_logits, dynamic=False)

    def prefill_logits(self, requests: list[Request]) -> tuple[Tensor, int]:
        """Run sequences (prompt plus tokens so far, after the `cached` positions their slot already holds) into
        their cache slots -> (next-token logits [N, V], the number of tokens the model ran).

        With `share_prefill` a sequence equal to an earlier one of `requests` (both prefilled whole) is not run:
        the earlier one's cache row is copied into its slot and its logits row repeated (the same tokens give the
        same keys, values and logits; each request then samples its own token)."""
        unique: list[Request] = []  # the sequences run through the model
        row_of: dict[tuple[int, ...], int] = {}  # a sequence -> its row among them
        rows, sources, copies = [], [], []  # each request's logits row; slots copied from and into
        for request in requests:
            key = tuple(request.all_ids())
            if self.config.share_prefill and request.cached == 0 and key in row_of:
                sources.append(unique[row_of[key]].slot)
                copies.append(request.slot)
            else:
                row_of[key] = len(unique)
                unique.append(request)
            rows.append(row_of[key])
        logits = self._run_prefill(unique)  # [U, V]
        num_run = sum(r.prefill_len for r in unique)
        if not copies:
            return logits, num_run
        self.cache.copy_rows(sources, copies, max(r.num_tokens for r in unique))
        return logits[torch.tensor(rows, device=logits.device)], num_run  # [N, V]

    def _run_prefill(self, requests: list[Request]) -> Tensor:
        """One forward over the requests' uncached tokens. Fresh sequences attend among their own tokens (the
        model's packed attention); continuations (all of the batch or none, see the scheduler) attend to their
        cached prefix as well (`CachedPrefixAttention`)."""
        sequences = [r.all_ids()[r.cached:] for r in requests]
        lengths = [len(s) for s in sequences]
        host = torch.tensor([t for s in sequences for t in s]
                            + [p for r, n in zip(requests, lengths) for p in range(r.cached, r.cached + n)]
                            + [r.slot for r, n in zip(requests, lengths) for _ in range(n)] + lengths)
        ids, positions, slots, lengths_t = host.to(self.device, non_blocking=True).split(
            [sum(lengths)] * 3 + [len(lengths)])
        cu_seqlens = torch.nn.functional.pad(lengths_t.cumsum(0), (1, 0)).int()  # [N+1]
        if requests[0].cached > 0:
            hook = CachedPrefixAttention(self.cache, slots, positions, [r.slot for r in requests],
                                         [r.cached for r in requests], lengths, self.config.bitwise)
        else:
            hook = PrefillAttention(self.cache, slots, positions, self.config.bitwise)
        if self.routing_layers is None:
            hidden = self.model(ids, positions, cu_seqlens, hook, max(lengths))
        else:
            table = RoutingTable.recording(ids.shape[0], self.routing_layers, self.model_config.moe.top_k,
                                           self.device)
            hidden = self._recording(table, slots, positions,
                                     lambda: self.model(ids, positions, cu_seqlens, hook, max(lengths)))
        return self.logits(hidden[cu_seqlens[1:] - 1])

    def _recording(self, table: RoutingTable, slots: Tensor, positions: Tensor, forward) -> Tensor:
        """Run `forward` with its MoE layers recording into `table`, then store each token's experts at its
        (slot, position) of the cache, beside its keys and values."""
        with attached(self.model, table):
            hidden = forward()
        table.complete([self.layout.tp_group])  # each TP rank recorded its share of the tokens
        self.cache.routing_ids[slots, positions] = table.experts.to(self.cache.routing_ids.dtype)
        return hidden

    def routed_experts(self, slot: int, num_tokens: int) -> Tensor | None:
        """The experts [num_tokens, L, k] of positions 0..num_tokens-1 of `slot` (a copy on the device, queued
        behind the steps launched so far); the last position, whose token no step ran, is marked unknown
        (`routing.unknown_expert`). None unless the runner records routing."""
        if self.routing_layers is None:
            return None
        routed = self.cache.routing_ids[slot, :num_tokens].clone()
        routed[-1] = unknown_expert(routed.dtype)
        return routed

    def load_decode_inputs(self, rows: list[Request | None], sampling: SamplingBatch,
                           idle_positions: dict[int, int]) -> None:
        """Inputs of the next decode steps for slots 0..len(rows)-1: per running request its last token and that
        token's position (a fed continuation: its next prompt token, `Request.next_input`); a slot without one
        (None) rides along at `idle_positions` (default 0) and stays there.
        `sampling` are the rows' settings."""
        padding = [0] * (self.num_decode_slots - len(rows))
        inputs = [r.next_input() if r else (0, idle_positions.get(slot, 0)) for slot, r in enumerate(rows)]
        host = torch.tensor([[token for token, _ in inputs] + padding, [pos for _, pos in inputs] + padding,
                             [int(r is not None) for r in rows] + padding])  # [3, S]
        self.inputs.copy_(host, non_blocking=True)
        self.sampling.load(sampling)

    def decode(self, num_rows: int, length: int, sampling: SamplingBatch) -> Tensor:
        """One decode step of slots 0..num_rows-1 from the input buffers, attending to `length` cache positions.

        Samples each row's next token with `sampling` (its rows: the same slots), writes it into the buffers as the
        next step's input and moves live rows one position on. Returns the step's rows [num_rows, 3] fp64 (token,
        logprob, raw logprob, the last equal to the logprob unless the batch asked for raw ones), on the device;
        valid until the next step. With graphs the whole step is one replay for any batch: seeded rows' uniforms are
        hashes of the seed buffers and the positions, no per-request random stream.
        """
        # The split-KV kernel reads each row's own tokens whatever the bound (which sets only its split count); the
        # reference slices the cache by it. One bound for every step means one graph per (rows, sampling mode)
        # instead of one per length bucket as well: a third as many captures after each wake, at most.
        length = self.cache.max_len if self._split_kv else length_bucket(length, self.cache.max_len)
        if not self._use_graphs(num_rows):
            self._sample_step(self._decode_logits(num_rows, length), sampling)
            return self.out[:num_rows]
        if self.graphs is None:
            self.graphs = DecodeGraphs(min(self.num_decode_slots, self.config.max_graph_rows), [self.inputs],
                                       self.generator)
        rows = self.graphs.rows_for(num_rows)
        fixed = self.sampling.view(sampling, rows)
        key = (rows, length, fixed.mode)
        capturing, start = not self.graphs.has(key), time.perf_counter()
        self.graphs.replay(key, lambda: self._sample_step(self._decode_logits(rows, length), fixed))
        if capturing:  # host time of the eager warm-up and the capture (`EngineStats.graph_capture_seconds`)
            self.graph_captures += 1
            self.graph_capture_seconds += time.perf_counter() - start
        return self.out[:num_rows]

    def feed_inputs(self, slots: list[int], tokens: list[int]) -> None:
        """Overwrite the next step's input token of `slots` with `tokens` (fed continuations' next prompt tokens,
        which the step before samples over); queued on the device after that step, like `retire`."""
        host = torch.tensor([slots, tokens])  # [2, F]
        slot_ids, token_ids = host.to(self.device, non_blocking=True)
        self.ids.index_copy_(0, slot_ids, token_ids)

    def retire(self, slots: list[int]) -> None:
        """Stop moving the rows of `slots` on (their requests stopped while later steps run ahead): their positions
        stay put from the next step queued on, so their k/v writes stay inside their slots. One fill per slot,
        queued on the device, no host read."""
        for slot in slots:
            self.live[slot] = 0

    def _decode_logits(self, num_rows: int, length: int) -> Tensor:
        return self.logits(self.decode_hidden(self.ids[:num_rows], self.positions[:num_rows], length))

    def _sample_step(self, logits: Tensor, sampling: SamplingBatch) -> None:
        """logits [N, V] of rows 0..N-1 -> their tokens into the input buffers and `out`."""
        num_rows = logits.shape[0]
        counters = self.positions[:num_rows] + 1  # the index in its sequence of the token each row draws
        drawn = sample(logits, sampling, counters, self.generator, self.config.bitwise, self.config.fused_sampling)
        self.ids[:num_rows].copy_(drawn.token_ids)
        self.positions[:num_rows].add_(self.live[:num_rows])
        raw = drawn.logprobs if drawn.raw_logprobs is None else drawn.raw_logprobs
        torch.stack([drawn.token_ids.double(), drawn.logprobs.double(), raw.double()], dim=1,
                    out=self.out[:num_rows])

    def decode_hidden(self, ids: Tensor, positions: Tensor, length: int) -> Tensor:
        """The portable decode forward (and what the CUDA graphs capture): ids, positions [B] -> hidden [B, H]."""
        num_rows = ids.shape[0]
        cu_seqlens = torch.arange(num_rows + 1, dtype=torch.int32, device=ids.device)
        hook = DecodeAttention(self.cache, positions, length, self.config.bitwise)
        if self.routing_layers is None:
            return self.model(ids, positions, cu_seqlens, hook, 1)
        table = RoutingTable(self._decode_routing[:num_rows].zero_(), self.routing_layers, replay=False)
        slots = torch.arange(num_rows, device=ids.device)  # decode row b is slot b
        return self._recording(table, slots, positions, lambda: self.model(ids, positions, cu_seqlens, hook, 1))

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, H] -> full-vocab logits [N, V] on every TP rank."""
        logits = self.model.compute_logits(hidden, hidden.shape[0])  # [N, Vp/tp]
        return gather_vocab(logits, self.layout.tp_group, self.model_config.vocab_size)

    @property
    def adapted_weights(self) -> list[nn.Parameter]:
        """The base weights the LoRA adapters are folded into (none with runtime or no adapters)."""
        by_id = {id(p): p for p in self.model.parameters()}
        return [by_id[key] for key in self._folds]

    @torch.no_grad()
    def fold_adapters(self, rewritten: Iterable[nn.Parameter]) -> None:
        """New weights are in place: write W = W_base + s B A into every adapted weight, in fp32 as the merged HF
        export computes it. `rewritten`: base weights the update wrote (the first sync moves every tensor, later
        ones the adapters alone), whose pristine copies are taken again from what was written; every other fold
        starts from its pristine copy, never from the folded weight."""
        if not self._folds:
            return
        for param in rewritten:
            if id(param) in self._folds:
                self._pristine[id(param)] = _host_copy(param)
        for param in self.adapted_weights:
            a, b, scale = self._folds[id(param)]
            if id(param) not in self._pristine:  # weights loaded before any update (a checkpoint, or initial)
                self._pristine[id(param)] = _host_copy(param)
            base = self._pristine[id(param)].to(param.device, non_blocking=True)
            delta = torch.matmul(b.float(), a.float())  # [out, r] @ [r, in], or per expert [E, out, r] @ [E, r, in]
            param.copy_((base.float() + scale * delta).to(param.dtype))

    def release_memory(self, offload_weights: bool) -> None:
        """Free the cache (and the graphs pointing into it); with `offload_weights` move weights to pinned host
        memory (a no-op on CPU)."""
        self.cache.free()
        self.graphs = None
        if offload_weights and self.device.type == "cuda":
            for group in self.model.column_groups():
                unpack(group)
            for param in self.model.parameters():
                param.data = torch.empty_like(param, device="cpu", pin_memory=True).copy_(param)
            self.offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore_memory(self, kv_cache: bool) -> None:
        if self.offloaded:
            self._pack_projections()  # straight from the pinned host copies into packed device buffers
            for param in self.model.parameters():
                if param.device != self.device:
                    param.data = param.data.to(self.device, non_blocking=True)
            self.offloaded = False
        if kv_cache and not self.cache.allocated:
            self.cache.allocate()

    def _pack_projections(self) -> None:
        """Store each layer's q/k/v and gate/up weights back to back on the device, so each group runs as one GEMM
        (`apply_columns`): three fewer GEMM launches per layer and decode step, whose fixed costs dominate a step of a
        small model. Weight loads and syncs copy in place, so the packing lasts until an offload."""
        for group in self.model.column_groups():
            pack_adjacent(group, self.device)

    def padded_rows(self, num_rows: int) -> int:
        """The rows a decode step of `num_rows` slots computes: its graph's bucket, or itself when eager."""
        if not self._use_graphs(num_rows):
            return num_rows
        return next(b for b in row_buckets(min(self.num_decode_slots, self.config.max_graph_rows)) if b >= num_rows)

    def _use_graphs(self, num_rows: int) -> bool:
        """CUDA graphs need a step without host reads: an MoE model whose dispatch learns its sizes from the device
        (experts over EP ranks; see `MoELayer.reads_host`) decodes eagerly."""
        return (self.device.type == "cuda" and not self.config.enforce_eager and not self._reads_host
                and num_rows <= self.config.max_graph_rows)

    def _build_cache(self) -> KVCache:
        config, model = self.config, self.model_config
        kv_heads = max(model.num_kv_heads // self.layout.tp_size, 1)
        routing = None
        if self.routing_layers is not None:
            routing = (len(self.routing_layers), model.moe.top_k, expert_id_dtype(model.moe.num_experts))
        per_slot = KVCache.bytes_per_slot(model.num_layers, config.max_model_len, kv_heads, model.head_dim,
                                          config.dtype, routing)
        if self.device.type == "cuda":
            budget = gpu_cache_budget(self.device, config.gpu_memory_utilization, self._activation_bytes())
            source = "gpu_memory_utilization"
        else:
            budget = config.cpu_kv_cache_tokens * per_slot // config.max_model_len
            source = "cpu_kv_cache_tokens"
        slots = num_slots_for_budget(budget, per_slot, config.max_num_seqs, source)
        spare = max(0, budget // per_slot - slots) if config.spare_cache_rows else 0
        return KVCache(model.num_layers, slots + spare, config.max_model_len, kv_heads, model.head_dim, config.dtype,
                       self.device, routing)

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
        sample(logits, SamplingBatch.build(params, [None] * rows, self.model_config.vocab_size, self.device),
               positions[:rows])
        del logits
        return torch.cuda.max_memory_allocated(self.device) - base


def _host_copy(param: Tensor) -> Tensor:
    """A copy of `param` in host memory (pinned on CUDA, so folds copy it back asynchronously)."""
    copy = torch.empty(param.shape, dtype=param.dtype, pin_memory=param.is_cuda)
    return copy.copy_(param)
