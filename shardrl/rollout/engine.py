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
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import hf_name_index, load_hf_tensor, load_hf_weights
from shardrl.parallel.layout import Layout
from shardrl.rollout.request import Request, RequestOutput, SamplingParams
from shardrl.rollout.runner import EngineConfig, ModelRunner
from shardrl.rollout.sampler import SamplingBatch, sample
from shardrl.rollout.scheduler import Scheduler


@dataclass
class EngineStats:
    """Work done since the last reset (`engine.stats = EngineStats()`), for throughput metrics. Step times are
    wall-clock; each step ends in a device-to-host copy, so they include the device work."""

    prefill_steps: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0


class EngineError(ValueError):
    """A request or layout the engine cannot serve; the message names the value and the setting."""


class Engine:
    def __init__(self, model_config: ModelConfig, layout: Layout, config: EngineConfig = EngineConfig()) -> None:
        _check_layout(layout, model_config)
        self.model_config, self.layout, self.config = model_config, layout, config
        self.device = layout.device
        self.runner = ModelRunner(model_config, layout, config)
        self.model = self.runner.model  # weight sync writes into its parameters' shards (by their specs)
        self._names = hf_name_index(self.model)
        self.policy_version = 0
        self.eos_ids = frozenset(_eos_ids(model_config) if config.eos_token_ids is None else config.eos_token_ids)
        self.scheduler = Scheduler(self.runner.cache.num_slots, config.max_num_seqs, config.max_num_batched_tokens)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.stats = EngineStats()
        self._paused: dict[str, Request] = {}
        self._counter = itertools.count()
        self._sampling: tuple[list[Request], SamplingBatch] | None = None  # the last batch's, see `_sampling_batch`

    @classmethod
    def from_pretrained(cls, path: str | Path, layout: Layout, config: EngineConfig = EngineConfig()) -> Engine:
        engine = cls(ModelConfig.from_pretrained(path), layout, config)
        load_hf_weights(engine.model, path)
        return engine

    # ---- weights -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, Tensor]], version: int | None = None) -> None:
        """Load full HF tensors (any subset, streamed one at a time) into this rank's shards, through the same shard
        specs as checkpoint loading; then `policy_version` becomes `version` (default: one more).

        Requests still running keep the KV cache their earlier tokens computed under the old weights; `abort()`
        before and `resume()` after re-prefill them under the new ones."""
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
        self.runner.release_memory(offload_weights)

    def wake_up(self, kv_cache: bool = True) -> None:
        """Weights back on the device first, then (unless `kv_cache=False`, e.g. to sync weights in between) the
        KV cache, so the two never peak together."""
        self.runner.restore_memory(kv_cache)

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
        if self.runner.cache.data is None:
            raise EngineError("step: the engine is asleep; call wake_up() first")
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        start, prefill = time.perf_counter(), batch.kind == "prefill"
        num_tokens = sum(r.num_tokens for r in batch.requests) if prefill else len(batch.requests)
        logits = self.runner.prefill_logits(batch.requests) if prefill else self.runner.decode_logits(batch)
        finished = self._sample_and_record(batch.requests, logits)
        seconds = time.perf_counter() - start
        if prefill:
            self.stats.prefill_steps += 1
            self.stats.prefill_tokens += num_tokens
            self.stats.prefill_seconds += seconds
        else:
            self.stats.decode_steps += 1
            self.stats.decode_tokens += num_tokens
            self.stats.decode_seconds += seconds
        return finished

    def _sample_and_record(self, requests: list[Request], logits: Tensor) -> list[RequestOutput]:
        """logits [N, V] -> one new token per request; returns the requests this finished."""
        drawn = sample(logits, self._sampling_batch(requests), self.generator)
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

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        """The requests' sampling settings as tensors, built again only when the batch holds other requests: decode
        steps of an unchanged running set (most steps) reuse them and make no host-to-device copies for them."""
        cached = self._sampling
        if cached is None or len(cached[0]) != len(requests) or any(a is not b for a, b in zip(cached[0], requests)):
            batch = SamplingBatch.build([r.params for r in requests], [r.generator for r in requests],
                                        self.model_config.vocab_size, self.device)
            cached = self._sampling = (list(requests), batch)
        return cached[1]

    def stream(self) -> Iterator[RequestOutput]:
        """Yield requests as they finish until none is left (requests submitted meanwhile are included)."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order, the `n` samples of a prompt next to each other."""
        if self.has_unfinished():
            raise EngineError("generate: requests are already in flight; use submit() and stream() to mix them")
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
