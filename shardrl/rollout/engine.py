"""The native rollout engine: the training model's own definitions (`shardrl.models.Transformer`, its TP layers and
MoE block) run in inference mode with a KV cache, continuous batching and per-token logprobs.

One `Engine` is one replica over its layout's TP group (experts EP- or tensor-split inside that group). Every TP
rank of a replica makes the same calls with the same arguments (SPMD); replicas are independent engines.

Use:
    engine = Engine(model_config, layout, EngineConfig(...)); engine.update_weights(hf_tensors)
    outputs = engine.generate(prompts, SamplingParams(...))               # batch, synchronous
    engine.submit(prompt, params); for out in engine.stream(): ...       # streaming, for the async trainer
    partial = engine.abort(); engine.update_weights(new, version=7); engine.resume()   # partial rollout
    engine.sleep(offload_weights=True); ...; engine.wake_up(kv_cache=False)       # colocated weight sync:
    ...sync writes the shards in place...; engine.set_policy_version(8); engine.wake_up()   # KV cache after it

With `EngineConfig.record_routing` (MoE) a finished request's output carries the experts every MoE layer chose for
each of its tokens (`RequestOutput.routed_experts`): the routing that computed its cached keys and values, kept
beside them per (slot, position) and written by the same prefill and decode steps (CUDA graphs, run-ahead, shared
prefills, cached and fed continuations included). A request resumed after an abort is re-prefilled under the new
weights, and so is its routing: the tokens after it attended to those keys. A weight update drops parked caches
with their routing alike.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import hf_name_index, load_hf_tensor, load_hf_weights
from shardrl.parallel.layout import Layout
from shardrl.rollout.host_copy import HostCopies, HostCopy
from shardrl.rollout.request import Request, RequestOutput, SamplingParams
from shardrl.rollout.runner import EngineConfig, ModelRunner
from shardrl.rollout.sampler import SamplingBatch, sample
from shardrl.rollout.scheduler import Batch, RowMove, Scheduler


@dataclass
class EngineStats:
    """Work done since the last reset (`engine.stats = EngineStats()`), for throughput metrics. Step times are
    wall-clock per `step()` call; `decode_wait_seconds` is the part spent waiting for the device, so the host's own
    time per decode step is `(decode_seconds - decode_wait_seconds) / decode_steps`. `decode_host_launches` counts
    decode steps whose inputs came from the host (the batch had changed) instead of the step before them.
    `prefill_tokens` are the tokens the model ran: a sequence that shared another's prefill adds none."""

    prefill_steps: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_wait_seconds: float = 0.0
    decode_host_launches: int = 0
    cached_prefill_tokens: int = 0  # tokens a continuation found cached instead of prefilling them
    fed_tokens: int = 0  # continuations' new tokens fed through decode rows instead of a prefill
    prefix_moves: int = 0  # parked prefixes copied into or out of spare cache rows (`EngineConfig.spare_cache_rows`)
    graph_captures: int = 0  # decode CUDA graphs captured (again after every wake: the cache moved)
    graph_capture_seconds: float = 0.0


@dataclass(frozen=True)
class _Launched:
    """A decode step queued on the device, recorded by the `step()` call that launched it or, launched ahead, by
    the next one: the running `requests` (slot order) and their `slots` at launch, rows 0..num_rows-1 attending to
    `length` positions."""

    requests: list[Request]
    slots: list[int]
    num_rows: int
    length: int
    sampling: SamplingBatch
    copy: HostCopy


class EngineError(ValueError):
    """A request or layout the engine cannot serve; the message names the value and the setting."""


class Engine:
    def __init__(self, model_config: ModelConfig, layout: Layout, config: EngineConfig = EngineConfig()) -> None:
        _check_layout(layout, model_config)
        _check_config(config, model_config, layout)
        self.model_config, self.layout, self.config = model_config, layout, config
        self.device = layout.device
        self.runner = ModelRunner(model_config, layout, config)
        self.model = self.runner.model  # weight sync writes into its parameters' shards (by their specs)
        self._names = hf_name_index(self.model)
        self.policy_version = 0
        self.torn_by: str | None = None  # why the weights hold a mix of two versions (a failed sync), if they do
        self.eos_ids = frozenset(_eos_ids(model_config) if config.eos_token_ids is None else config.eos_token_ids)
        decode_slots = self.runner.num_decode_slots
        self.scheduler = Scheduler(decode_slots, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_fed_tokens, range(decode_slots, self.runner.cache.num_slots))
        self.stats = EngineStats()
        self._paused: dict[str, Request] = {}
        self._counter = itertools.count()
        self._copies = HostCopies(decode_slots, 3, self.device)
        self._ahead: _Launched | None = None  # the decode step the next `step()` records, already on the device

    @classmethod
    def from_pretrained(cls, path: str | Path, layout: Layout, config: EngineConfig = EngineConfig()) -> Engine:
        engine = cls(ModelConfig.from_pretrained(path), layout, config)
        load_hf_weights(engine.model, path)
        engine.runner.fold_adapters(engine.runner.adapted_weights)  # e.g. adapters loaded from a PEFT adapter
        return engine

    # ---- weights -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, Tensor]], version: int | None = None) -> None:
        """Load full HF tensors (any non-empty subset, streamed one at a time) into this rank's shards, through the
        same shard specs as checkpoint loading; then `policy_version` becomes `version` (default: one more).

        Requests still running keep the KV cache their earlier tokens computed under the old weights; `abort()`
        before and `resume()` after re-prefill them under the new ones."""
        written: dict[int, nn.Parameter] = {}
        for name, full in weights:
            if name not in self._names:
                raise EngineError(f"update_weights: {name!r} is not a tensor of this {self.model_config.architecture}")
            param, expert = self._names[name]
            load_hf_tensor(param, expert, full)
            written[id(param)] = param
        if not written:
            raise EngineError("update_weights: no tensors given; after weights were written into the shards in "
                              "place (weight sync), call set_policy_version instead")
        self.set_policy_version(version, rewritten=written.values())

    def set_policy_version(self, version: int | None = None, rewritten: Iterable[nn.Parameter] = ()) -> None:
        """New weights are in place (written into this rank's shards by `update_weights` or by weight sync): tokens
        sampled from now on carry `version` (default: one more) as their policy version. With LoRA the adapters are
        folded into the weights now; `rewritten`: the base weights the update wrote (a sync's first run writes
        every tensor: `model.parameters()`; later runs of a LoRA model the adapters alone)."""
        self._drop_ahead()  # its tokens would carry the new version but come from the old weights
        self.scheduler.release_parked()  # their keys and values came from the old weights
        self.runner.fold_adapters(rewritten)
        self.policy_version = self.policy_version + 1 if version is None else version
        self.torn_by = None

    def refuse_torn_weights(self, reason: str) -> None:
        """A weight sync into these shards failed part-way (`reason`), leaving a mix of two versions: every `step`
        raises until new weights are complete (`set_policy_version`), so no token is sampled from them."""
        self.torn_by = reason

    def sleep(self, offload_weights: bool = False) -> None:
        """Free the KV cache (and with `offload_weights` move the weights to pinned host memory) so training can
        use the GPU. Requests must be finished or aborted first."""
        if self.scheduler.has_work():
            raise EngineError("sleep: requests are still in flight; call abort() or run them to completion first")
        self._drop_ahead()
        self.scheduler.release_parked()
        self.runner.release_memory(offload_weights)

    def wake_up(self, kv_cache: bool = True) -> None:
        """Weights back on the device first, then (unless `kv_cache=False`, e.g. to sync weights in between) the
        KV cache, so the two never peak together."""
        self.runner.restore_memory(kv_cache)

    # ---- requests ------------------------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               keep_cache: bool = False, continues: str | None = None) -> list[str]:
        """Queue `params.n` samples of one prompt; returns their request ids (`<id>` or `<id>/<i>` when n > 1).

        Multi-turn: with `keep_cache` a finished request keeps its KV-cache slot (parked) until a request that
        `continues` it arrives or `release_cache` frees it. A continuation's prompt is the parked sequence plus the
        turn's new tokens; it takes the parked slot and prefills only what is not cached (the parked sequence's
        last token, whose keys the cache may lack, and the new tokens). A slot lent to a new sequence meanwhile
        leaves the prefix in a spare row (`EngineConfig.spare_cache_rows`), copied back when the continuation runs;
        when the prefix went (no spare row, a weight update) the continuation is prefilled whole, with the same
        result."""
        if not 0 < len(prompt_ids) < self.config.max_model_len:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens: needs 1 to max_model_len-1="
                              f"{self.config.max_model_len - 1} tokens")
        if self.config.bitwise and params.filtered:
            raise EngineError(f"bitwise mode: top_k={params.top_k}, top_p={params.top_p} filter the distribution the "
                              f"trainer scores unfiltered; sample with top_k=-1, top_p=1.0")
        if continues is not None and params.n != 1:
            raise EngineError(f"submit(continues={continues!r}): a continuation is one sequence; n={params.n}")
        if self.config.logprobs_mode == "raw_logprobs" and not params.raw_logprobs:
            params = dataclasses.replace(params, raw_logprobs=True)  # the sampler computes them only when asked
        base = str(next(self._counter)) if request_id is None else request_id
        ids = [base] if params.n == 1 else [f"{base}/{i}" for i in range(params.n)]
        for i, rid in enumerate(ids):
            seed = None if params.seed is None else params.seed + i
            stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
            request = Request(rid, list(prompt_ids), params, stop, self.config.max_model_len, seed,
                              keep_cache=keep_cache)
            if continues is not None:
                self._take_cache(continues, request)
            self.scheduler.add(request)
        return ids

    def _take_cache(self, parked_id: str, request: Request) -> None:
        """Hand `request` the slot (or spare row) of parked `parked_id` with the prefix they share (if still
        parked)."""
        parked = self.scheduler.take_parked(parked_id)
        if parked is None:
            return
        request.slot, request.spare = parked.slot, parked.spare
        request.cached = min(common_prefix(parked.all_ids(), request.prompt_ids), parked.num_tokens - 1,
                             len(request.prompt_ids) - 1)
        if request.cached == 0:
            self.scheduler.free_slot(request)

    def release_cache(self, request_ids: Iterable[str] | None = None) -> None:
        """Free the slots of parked requests (all when None): their trajectories ended."""
        self.scheduler.release_parked(None if request_ids is None else set(request_ids))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def max_running(self) -> int:
        """Sequences the engine runs at once: min(KV-cache slots, max_num_seqs)."""
        return self.scheduler.max_running

    def free_capacity(self) -> int:
        """Requests that can be submitted now without waiting for a slot (running and queued ones take theirs)."""
        return self.scheduler.max_running - len(self.scheduler.running) - len(self.scheduler.waiting)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one prefill or decode step; return the requests that finished in it.

        Decode steps run one ahead on the device: before recording step k this launches step k+1, whose inputs
        (the tokens step k samples, the next positions) step k writes on the device, so the GPU computes k+1 while
        the host appends k's tokens. A request that stops at step k leaves one wasted row in step k+1, whose token
        is never recorded. Only a step that changes nothing for the host runs ahead: no request reaching its token
        limit in step k, none waiting that a free slot could take (a prefill comes first). Otherwise the batch
        changes and its next step is launched from the host's view of the requests.
        """
        if not self.runner.cache.allocated:
            raise EngineError("step: the engine is asleep; call wake_up() first")
        if self.torn_by is not None:
            raise EngineError(f"step: the last weight sync failed part-way ({self.torn_by}), so the weights mix two "
                              f"policy versions; generation waits for a sync that completes")
        captures, capture_seconds = self.runner.graph_captures, self.runner.graph_capture_seconds
        finished = self._step()
        self.stats.graph_captures += self.runner.graph_captures - captures
        self.stats.graph_capture_seconds += self.runner.graph_capture_seconds - capture_seconds
        return finished

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        current = self._ahead
        if current is None:
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            self._move_rows(batch.moves)
            if batch.kind == "prefill":
                return self._prefill(batch.requests, start)
            current = self._launch(batch)
        self._ahead = self._launch_ahead(current) if self._may_run_ahead(current) else None
        waited = time.perf_counter()
        rows = current.copy.rows()
        self.stats.decode_wait_seconds += time.perf_counter() - waited
        live = [(r, slot) for r, slot in zip(current.requests, current.slots)
                if r.finish_reason is None and r.slot == slot]
        finished = self._record([(r, rows[slot]) for r, slot in live])
        if self._ahead is not None:  # rows that stopped now ride along dead from the step after the one ahead
            self.runner.retire([slot for r, slot in live if r.finish_reason is not None])
        if self._ahead is not None and all(r.finish_reason is not None for r in self._ahead.requests):
            self._drop_ahead()  # every row stopped: nothing of it will be recorded
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(live)
        self.stats.decode_seconds += time.perf_counter() - start
        return finished

    def _move_rows(self, moves: list[RowMove]) -> None:
        """Run a step's prefix copies in their order, as few batched copies as keep it: a move that reads or
        writes a row an earlier move of the group writes starts a new group."""
        group: list[RowMove] = []
        for move in [*moves, None]:
            written = {m.destination for m in group}
            if group and (move is None or move.source in written or move.destination in written):
                self.runner.cache.copy_rows([m.source for m in group], [m.destination for m in group],
                                            max(m.length for m in group))
                group = []
            if move is not None:
                group.append(move)
        self.stats.prefix_moves += len(moves)

    def _prefill(self, requests: list[Request], start: float) -> list[RequestOutput]:
        logits, num_tokens = self.runner.prefill_logits(requests)
        sampling = SamplingBatch.build([r.params for r in requests], [r.seed for r in requests],
                                       self.model_config.vocab_size, self.device)
        # Each draws the token at index num_tokens of its sequence (the same counter a decode step would use).
        counters = torch.tensor([r.num_tokens for r in requests]).to(self.device, non_blocking=True)
        drawn = sample(logits, sampling, counters, self.runner.generator, self.config.bitwise,
                       self.config.fused_sampling)
        raw = drawn.logprobs if drawn.raw_logprobs is None else drawn.raw_logprobs
        rows = torch.stack([drawn.token_ids.double(), drawn.logprobs.double(), raw.double()], dim=1).tolist()
        finished = self._record(list(zip(requests, rows)))
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += num_tokens
        self.stats.cached_prefill_tokens += sum(r.cached for r in requests)
        self.stats.prefill_seconds += time.perf_counter() - start
        return finished

    def _launch(self, batch: Batch) -> _Launched:
        """A decode step whose inputs the host writes: the running requests' last tokens, by slot."""
        rows: list[Request | None] = [None] * batch.num_rows
        for request in batch.requests:
            rows[request.slot] = request
        # A free slot samples like a running one (unseeded): its row then never changes which ops `sample` runs.
        params = [(r or batch.requests[0]).params for r in rows]
        seeds = [r.seed if r else None for r in rows]
        sampling = SamplingBatch.build(params, seeds, self.model_config.vocab_size, self.device)
        self.runner.load_decode_inputs(rows, sampling, batch.idle_positions)
        length = max(r.num_tokens for r in batch.requests)
        self.stats.decode_host_launches += 1
        out = self.runner.decode(batch.num_rows, length, sampling)
        return _Launched(batch.requests, [r.slot for r in batch.requests], batch.num_rows, length, sampling,
                         self._copies.start(out))

    def _may_run_ahead(self, step: _Launched) -> bool:
        """Whether the step after `step` may run the same slots, whatever `step` samples: no request waits for a free
        slot, and every row whose request stopped (on a stop token, which no one can foresee) or reaches its token
        limit in `step` stays inside the cache as a dead row: it advances one position in the step already launched
        when its end was seen, then none (`retire`). A dead row costs a wasted row per step until the batch is next
        launched from the host, where every end used to force that launch (and the GPU to wait for the host): every
        few steps of a large batch, nearly every step of multi-turn rollouts, whose turns end all the time. Ends
        launch from the host only when that shrinks the batch's padded rows (a graph bucket on GPU; the rows
        themselves when eager): the ended rows held its last slots. A fed continuation's rows run ahead too: their
        next inputs are prompt tokens the host knows (`_launch_ahead`)."""
        if self.scheduler.can_admit():
            return False
        kept = [slot for r, slot in zip(step.requests, step.slots)
                if r.finish_reason is None and not r.reaches_length(1)]
        return (bool(kept) and self.runner.padded_rows(max(kept) + 1) == self.runner.padded_rows(step.num_rows)
                and all(r.num_tokens + (r.finish_reason is None) < r.max_len for r in step.requests))

    def _launch_ahead(self, step: _Launched) -> _Launched:
        """The step after `step`, from the inputs `step` leaves on the device; a fed continuation's row whose next
        input is still a prompt token (not what `step` samples) gets it written over, queued after `step`. Its
        `feed` is the position `step` feeds: the host has recorded every step before it."""
        fed = [(r.slot, r.prompt_ids[r.feed + 1]) for r in step.requests
               if r.feed is not None and r.feed + 1 < r.num_tokens]
        if fed:
            self.runner.feed_inputs(*map(list, zip(*fed)))
        out = self.runner.decode(step.num_rows, step.length + 1, step.sampling)
        return replace(step, length=step.length + 1, copy=self._copies.start(out))

    def _drop_ahead(self) -> None:
        """Forget the step launched ahead (the batch or the weights change first). Nothing to undo: a seeded row's
        draw is a function of its seed and position, which the step that replaces it repeats."""
        self._ahead = None

    def _record(self, rows: list[tuple[Request, list[float]]]) -> list[RequestOutput]:
        """Append each request's (token, logprob, raw logprob) row; returns the requests this finished."""
        finished = []
        for request, (token, logprob, raw) in rows:
            if request.feed is not None:  # a fed continuation's row: only the last prompt token's sample counts
                self.stats.fed_tokens += 1
                if request.feed < request.num_tokens - 1:
                    request.feed += 1
                    continue
                request.feed = None
            reported = raw if self.config.logprobs_mode == "raw_logprobs" else logprob
            request.append(int(token), reported, raw if request.params.raw_logprobs else None, self.policy_version)
            if request.finish_reason is not None:
                routed = self.runner.routed_experts(request.slot, request.num_tokens)  # before the slot goes
                self.scheduler.release(request)
                finished.append(request.output(routed))
        return finished

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
        self._drop_ahead()  # an aborted request must not keep a token it was never given
        taken = self.scheduler.remove(None if request_ids is None else set(request_ids))
        if keep:
            self._paused.update((r.request_id, r) for r in taken)
        return [r.output() for r in taken]

    def resume(self, request_ids: Iterable[str] | None = None) -> None:
        """Queue paused requests again, ahead of new ones; they are re-prefilled from prompt plus tokens so far."""
        ids = list(self._paused) if request_ids is None else list(request_ids)
        for rid in reversed(ids):
            self.scheduler.add(self._paused.pop(rid), front=True)


def _check_config(config: EngineConfig, model_config: ModelConfig, layout: Layout) -> None:
    if config.record_routing and model_config.moe is None:
        raise EngineError(f"record_routing: {model_config.architecture} is a dense model; there is no MoE routing to "
                          f"record")
    if config.bitwise:
        if layout.device.type != "cuda" or config.dtype not in (torch.bfloat16, torch.float16):
            raise EngineError(f"bitwise mode runs batch-invariant CUDA kernels in half precision, not on "
                              f"{layout.device.type} in {config.dtype}; use a GPU and dtype bfloat16")
        if layout.tp_size > 1:
            raise EngineError(f"bitwise mode: tensor_model_parallel_size={layout.tp_size} sums partial results "
                              f"across ranks in an order the collective picks by size; use 1")


def _check_layout(layout: Layout, model_config: ModelConfig) -> None:
    if layout.pp_size > 1:
        raise EngineError(f"rollout pipeline parallel size {layout.pp_size}: the engine runs the whole model per "
                          f"rank; use tensor_model_parallel_size instead")
    if model_config.moe is not None and layout.ep_size * layout.etp_size != layout.tp_size:
        raise EngineError(f"rollout expert_parallel_size={layout.ep_size} x expert TP {layout.etp_size} must equal "
                          f"tensor_model_parallel_size={layout.tp_size}: experts stay inside one engine replica")


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _eos_ids(config: ModelConfig) -> tuple[int, ...]:
    eos = config.hf_config.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
