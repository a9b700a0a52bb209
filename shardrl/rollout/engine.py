"""The native rollout engine: the training model's own definitions (`shardrl.models.Transformer`, its TP layers and
MoE block) run in inference mode with a KV cache, continuous batching and per-token logprobs.

One `Engine` is one replica over its layout's TP group (experts EP- or tensor-split inside that group). Every TP
rank of a replica makes the same calls with the same arguments (SPMD); replicas are independent engines.

Use:
    engine = Engine(model_config, layout, EngineConfig(...)); engine.update_weights(hf_tensors)
    outputs = engine.generate(prompts, SamplingParams(...))               # batch, synchronous
    engine.submit(prompt, params); for out in engine.stream(): ...       # streaming, for the async trainer
    partial = engine.abort(); engine.update_weights(new, version=7); engine.resume()   # partial rollout
    engine.sleep(offload_weights=True); ...; engine.wake_up(kv_cache=False); sync weights; engine.wake_up()
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import hf_name_index, load_hf_tensor, load_hf_weights
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import Layout
from shardrl.parallel.tensor import gather_vocab
from shardrl.rollout.cuda_graphs import DecodeGraphs, length_bucket
from shardrl.rollout.kv_cache import (
    DecodeAttention,
    KVCache,
    PrefillAttention,
    gpu_cache_budget,
    num_slots_for_budget,
)
from shardrl.rollout.request import Request, RequestOutput, SamplingParams
from shardrl.rollout.sampler import SamplingBatch, sample
from shardrl.rollout.scheduler import Batch, Scheduler


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


class EngineError(ValueError):
    """A request or layout the engine cannot serve; the message names the value and the setting."""


class Engine:
    def __init__(self, model_config: ModelConfig, layout: Layout, config: EngineConfig = EngineConfig()) -> None:
        _check_layout(layout, model_config)
        self.model_config, self.layout, self.config = model_config, layout, config
        self.device = layout.device
        self.model = Transformer(model_config, layout, dtype=config.dtype).eval().requires_grad_(False)
        self._names = hf_name_index(self.model)
        self.policy_version = 0
        self.eos_ids = frozenset(_eos_ids(model_config) if config.eos_token_ids is None else config.eos_token_ids)
        self.cache = self._build_cache()
        self.scheduler = Scheduler(self.cache.num_slots, config.max_num_seqs, config.max_num_batched_tokens)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.graphs: DecodeGraphs | None = None
        self._paused: dict[str, Request] = {}
        self._offloaded = False
        self._counter = itertools.count()

    @classmethod
    def from_pretrained(cls, path: str | Path, layout: Layout, config: EngineConfig = EngineConfig()) -> Engine:
        engine = cls(ModelConfig.from_pretrained(path), layout, config)
        load_hf_weights(engine.model, path)
        return engine

    # ---- weights -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, Tensor]], version: int | None = None) -> None:
        """Load full HF tensors (any subset, streamed one at a time) into this rank's shards, through the same shard
        specs as checkpoint loading; then `policy_version` becomes `version` (default: one more)."""
        for name, full in weights:
            if name not in self._names:
                raise EngineError(f"update_weights: {name!r} is not a tensor of this {self.model_config.architecture}")
            load_hf_tensor(*self._names[name], full)
        self.policy_version = self.policy_version + 1 if version is None else version

    def sleep(self, offload_weights: bool = False) -> None:
        """Free the KV cache (and with `offload_weights` move the weights to pinned host memory) so training can
        use the GPU. Requests must be finished or aborted first."""
        if self.scheduler.has_work():
            raise EngineError("sleep: requests are still in flight; call abort() or run them to completion first")
        self.cache.free()
        self.graphs = None  # they point into the freed cache
        if offload_weights and self.device.type == "cuda":
            for param in self.model.parameters():
                param.data = torch.empty_like(param, device="cpu", pin_memory=True).copy_(param)
            self._offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, kv_cache: bool = True) -> None:
        """Weights back on the device first, then (unless `kv_cache=False`, e.g. to sync weights in between) the
        KV cache, so the two never peak together."""
        if self._offloaded:
            for param in self.model.parameters():
                param.data = param.data.to(self.device, non_blocking=True)
            self._offloaded = False
        if kv_cache and self.cache.data is None:
            self.cache.allocate()

    # ---- requests ------------------------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> list[str]:
        """Queue `params.n` samples of one prompt; returns their request ids (`<id>` or `<id>/<i>` when n > 1)."""
        if not 0 < len(prompt_ids) < self.config.max_model_len:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens: needs 1 to max_model_len-1="
                              f"{self.config.max_model_len - 1} tokens")
        base = str(next(self._counter)) if request_id is None else request_id
        ids = [base] if params.n == 1 else [f"{base}/{i}" for i in range(params.n)]
        for i, rid in enumerate(ids):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(self.device).manual_seed(params.seed + i)
            stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
            self.scheduler.add(Request(rid, list(prompt_ids), params, stop, self.config.max_model_len, generator))
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one prefill or decode batch; return the requests that finished in it."""
        if self.cache.data is None:
            raise EngineError("step: the engine is asleep; call wake_up() first")
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        requests = batch.requests
        logits = self._prefill_logits(requests) if batch.kind == "prefill" else self._decode_logits(batch)
        sampling = SamplingBatch.build([r.params for r in requests], [r.generator for r in requests],
                                       self.model_config.vocab_size, self.device)
        drawn = sample(logits, sampling, self.generator)
        columns = [drawn.token_ids.double(), drawn.logprobs.double()]
        if drawn.raw_logprobs is not None:
            columns.append(drawn.raw_logprobs.double())
        rows = torch.stack(columns, dim=1).tolist()  # one device-to-host copy per step
        finished = []
        for request, row in zip(requests, rows):
            request.append(int(row[0]), row[1], row[2] if request.params.raw_logprobs else None,
                           self.policy_version)
            if request.finish_reason is not None:
                self.scheduler.release(request)
                finished.append(request.output())
        return finished

    def stream(self) -> Iterator[RequestOutput]:
        """Yield requests as they finish until none is left (requests submitted meanwhile are included)."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order, the `n` samples of a prompt next to each other."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        order = [rid for prompt, p in zip(prompts, per_prompt) for rid in self.submit(prompt, p)]
        done = {out.request_id: out for out in self.stream()}
        return [done[rid] for rid in order]

    def abort(self, request_ids: Iterable[str] | None = None, keep: bool = True) -> list[RequestOutput]:
        """Stop requests (all when None), free their cache slots and return what they generated so far. With `keep`
        they wait for `resume()`, which continues them (under whatever weights are loaded by then)."""
        taken = self.scheduler.remove(None if request_ids is None else set(request_ids))
        if keep:
            self._paused.update((r.request_id, r) for r in taken)
        return [r.output() for r in taken]

    def resume(self, request_ids: Iterable[str] | None = None) -> None:
        """Queue paused requests again, ahead of new ones; they are re-prefilled from prompt plus tokens so far."""
        ids = list(self._paused) if request_ids is None else list(request_ids)
        for rid in reversed(ids):
            self.scheduler.add(self._paused.pop(rid), front=True)

    # ---- forward passes ------------------------------------------------------------------------------------------

    def _prefill_logits(self, requests: list[Request]) -> Tensor:
        """Run whole sequences into their cache slots -> next-token logits [N, V] of each."""
        sequences = [r.all_ids() for r in requests]
        lengths = [len(s) for s in sequences]
        host = torch.tensor([t for s in sequences for t in s] + [p for n in lengths for p in range(n)]
                            + [r.slot for r, n in zip(requests, lengths) for _ in range(n)] + lengths)
        ids, positions, slots, lengths_t = host.to(self.device, non_blocking=True).split(
            [sum(lengths)] * 3 + [len(lengths)])
        cu_seqlens = torch.nn.functional.pad(lengths_t.cumsum(0), (1, 0)).int()  # [N+1]
        hidden = self.model(ids, positions, cu_seqlens, PrefillAttention(self.cache, slots, positions), max(lengths))
        return self._logits(hidden[cu_seqlens[1:] - 1])

    def _decode_logits(self, batch: Batch) -> Tensor:
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
                self.graphs = DecodeGraphs(self._decode_hidden, min(self.cache.num_slots, self.config.max_graph_rows),
                                           self.cache.max_len, self.device)
            hidden = self.graphs.run(ids_t, positions_t, length)
        else:
            hidden = self._decode_hidden(ids_t, positions_t, length_bucket(length, self.cache.max_len))
        return self._logits(hidden.index_select(0, active))

    def _decode_hidden(self, ids: Tensor, positions: Tensor, length: int) -> Tensor:
        """The portable decode forward (and what the CUDA graphs capture): ids, positions [B] -> hidden [B, H]."""
        num_rows = ids.shape[0]
        cu_seqlens = torch.arange(num_rows + 1, dtype=torch.int32, device=ids.device)
        return self.model(ids, positions, cu_seqlens, DecodeAttention(self.cache, positions, length), 1)

    def _logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, H] -> full-vocab logits [N, V] on every TP rank."""
        logits = self.model.compute_logits(hidden, hidden.shape[0])  # [N, Vp/tp]
        return gather_vocab(logits, self.layout.tp_group, self.model_config.vocab_size)

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
        tokens, rows = self.config.max_num_batched_tokens, min(self.config.max_num_seqs,
                                                               self.config.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        longest = min(tokens, self.config.max_model_len)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(tokens, device=self.device) % longest
        cu_seqlens = torch.tensor([*range(0, tokens, longest), tokens], dtype=torch.int32, device=self.device)
        hidden = self.model(ids, positions, cu_seqlens)
        logits = self._logits(hidden[:rows])
        params = [SamplingParams(top_p=0.9)] * rows  # the sort makes this the costliest sampling path
        sample(logits, SamplingBatch.build(params, [None] * rows, self.model_config.vocab_size, self.device))
        del hidden, logits
        return torch.cuda.max_memory_allocated(self.device) - base


def _check_layout(layout: Layout, model_config: ModelConfig) -> None:
    if layout.pp_size > 1:
        raise EngineError(f"rollout pipeline parallel size {layout.pp_size}: the engine runs the whole model per "
                          f"rank; use tensor_model_parallel_size instead")
    if model_config.moe is not None and layout.ep_size * layout.etp_size != layout.tp_size:
        raise EngineError(f"rollout expert_parallel_size={layout.ep_size} x expert TP {layout.etp_size} must equal "
                          f"tensor_model_parallel_size={layout.tp_size}: experts stay inside one engine replica")


def _eos_ids(config: ModelConfig) -> tuple[int, ...]:
    eos = config.hf_config.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
