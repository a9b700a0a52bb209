"""The rollout pool's worker in the detached placement (the async modes).

`RolloutWorker` builds only its own layout and the weight-sync group, nothing of the trainer's TP x PP x EP, so a
rollout pool need not fit the trainer's layout. Its engine serves in two ways: `generate_sequences` (a whole batch,
as the colocated worker) and `stream` (requests added and finished samples returned over many short calls: the
async modes' rollouter). Every call is SPMD over a replica's TP ranks, which get the same arguments, so the ranks of a
replica stay in lockstep without coordinating among themselves.
"""

from __future__ import annotations

from collections import deque

import torch

from shardrl.agents.driver import RunnerStats, build_runner
from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.controller.host import collective_timeout
from shardrl.data.batch import Batch
from shardrl.job.options import RolloutOptions
from shardrl.models.config import ModelConfig
from shardrl.parallel.layout import GroupRegistry
from shardrl.rollout.engine import Engine, EngineStats
from shardrl.rollout.request import SamplingParams
from shardrl.sync.detached import DetachedSync
from shardrl.workers.role_model import create_layout
from shardrl.workers.samples import (
    agent_samples,
    generate,
    generate_trajectories,
    prompt_ids_of,
    samples_batch,
    trajectories_batch,
)

REFILL_CHUNK = 8  # stream() admits new requests once 1/8 of the engine's slots are free
Backlog = deque[tuple[list[int], SamplingParams, Batch]]  # (prompt ids, sampling params, prompt row) per request


class RolloutWorker:
    def __init__(self, options: RolloutOptions, model_path: str, pad_token_id: int,
                 registry: GroupRegistry | None = None) -> None:
        torch.manual_seed(options.seed)
        self.options, self.pad_token_id = options, pad_token_id
        self.response_length = options.response_length
        registry = GroupRegistry() if registry is None else registry
        sync = options.weight_sync
        group = registry.sync_group(sync.ranks, collective_timeout())
        layout = create_layout(options.spec, options.ranks, registry)
        # Weights arrive by the first sync; until then the engine holds a random init.
        model_config = ModelConfig.from_pretrained(model_path, overrides=options.override_config)
        self.engine = Engine(model_config, layout, options.engine)
        self.weight_sync = DetachedSync.receiver(self.engine, group, sync.bucket_bytes, sync.verify)
        self.prompts: dict[str, Batch] = {}  # request id -> its prompt row, while the request runs
        self.backlog: Backlog = deque()  # streamed requests not yet in the engine
        self.agents = None if options.agent is None else build_runner(self.engine, options.agent)
        self.streamed = 0  # streamed trajectories started (their keys)

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def generate_sequences(self, prompts: Batch, validate: bool = False) -> Batch:
        """One response per row, as `ActorRolloutRefWorker.generate_sequences`. Streamed requests still running wait
        meanwhile (paused and resumed, under the same weights)."""
        sampling = self.options.validate if validate else self.options.train
        params = sampling.params(prompts.tensors["sample_seed"])
        if self.agents is not None:  # streamed trajectories go on beside these (same weights)
            return generate_trajectories(self.agents, prompts, params, self.response_length, self.pad_token_id)
        self.engine.abort(keep=True)
        samples = generate(self.engine, prompts, params, self.response_length, self.pad_token_id)
        self.engine.resume()
        return samples

    @dispatch_mode(Dispatch.PER_REPLICA)
    def stream(self, prompts: Batch | None, max_steps: int) -> tuple[Batch | None, dict[str, float]]:
        """Take one request per row of `prompts` (None: nothing new), run at most `max_steps` engine steps (fewer
        when the engine runs out of work) and return the samples that finished meanwhile, whichever call queued them
        (None if none did), with what the engine did (`rollouter.ENGINE_KEYS`, and its `slots`). Samples keep their
        prompt row's columns, `sample_seed` included.

        New requests wait in a backlog and enter the engine in refill chunks (`admit`). Multi-turn: each row is a
        trajectory of the agent runner, which queues its turns in the engine itself; a trajectory paused by a
        weight sync continues under the new weights."""
        if self.agents is not None:
            return self._stream_trajectories(prompts, max_steps)
        if prompts is not None:
            params = self.options.train.params(prompts.tensors["sample_seed"])
            self.backlog.extend((ids, p, prompts.take([row]))
                                for row, (ids, p) in enumerate(zip(prompt_ids_of(prompts), params)))
        self.engine.stats = EngineStats()
        finished = []
        for _ in range(max_steps):
            admit(self.engine, self.backlog, self.prompts)
            if not self.engine.has_unfinished():
                break
            finished += self.engine.step()
        report = self._report()
        if not finished:
            return None, report
        rows = Batch.concat([self.prompts.pop(out.request_id) for out in finished])
        samples = samples_batch(rows, finished, self.response_length, self.pad_token_id)
        samples.tensors["sample_seed"] = rows.tensors["sample_seed"]
        return samples, report

    def _stream_trajectories(self, prompts: Batch | None, max_steps: int) -> tuple[Batch | None, dict[str, float]]:
        if prompts is not None:
            params = self.options.train.params(prompts.tensors["sample_seed"])
            samples = []
            for row, sample, name in agent_samples(prompts, params):
                key = f"s{self.streamed}"
                self.streamed += 1
                self.prompts[key] = prompts.take([row])
                samples.append((key, sample, name))
            self.agents.start(samples)
        self.engine.stats = EngineStats()
        finished = self.agents.drive(max_steps)
        agent = self.agents.take_stats()
        report = self._report() | {"tool_idle_s": agent.tool_idle_seconds,
                                   "decode_steps_during_tools": agent.decode_steps_during_tools,
                                   "tool_idle_spans": agent.tool_idle_spans}
        if not finished:
            return None, report
        rows = Batch.concat([self.prompts.pop(key) for key in finished])
        samples = trajectories_batch(rows, list(finished.values()), self.response_length, self.pad_token_id)
        samples.tensors["sample_seed"] = rows.tensors["sample_seed"]
        return samples, report

    def _report(self) -> dict[str, float]:
        stats = self.engine.stats
        return {"engine_s": stats.prefill_seconds + stats.decode_seconds, "prefill_s": stats.prefill_seconds,
                "decode_steps": stats.decode_steps, "decode_rows": stats.decode_tokens,
                "prefill_tokens": stats.prefill_tokens, "graph_capture_s": stats.graph_capture_seconds,
                "slots": self.engine.max_running, "tool_idle_s": 0.0, "decode_steps_during_tools": 0,
                "tool_idle_spans": []}

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def take_agent_stats(self) -> RunnerStats | None:
        """The agent runner's stats since the last call (None: single turn)."""
        return None if self.agents is None else self.agents.take_stats()

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def sync_weights(self, version: int) -> dict[str, float]:
        """Receive the trainer's weights (with `DetachedActorWorker.sync_weights` at the same time). Requests in
        flight are paused around the transfer and continue under the new weights, re-prefilled from prompt and tokens
        so far: a partial rollout, whose later tokens carry `version`. The controller drains them first when it
        wants every sample from one version."""
        self.engine.abort(keep=True)
        metrics = self.weight_sync.sync(version)
        self.engine.resume()
        return metrics


def admit(engine: Engine, backlog: Backlog, prompts: dict[str, Batch]) -> None:
    """Move requests from `backlog` into `engine` (recording each one's prompt row under its request id): as many as
    have a free slot, once `slots / REFILL_CHUNK` slots are free or the whole backlog fits. Each admission is a
    prefill step that stalls every running sequence's decode, so the slots that finishing sequences free are refilled
    in batches rather than with one prefill per finished sequence; the engine stays at least 7/8 full meanwhile."""
    free = engine.free_capacity()
    if not backlog or free < min(-(-engine.max_running // REFILL_CHUNK), len(backlog)):
        return
    for _ in range(min(free, len(backlog))):
        ids, params, row = backlog.popleft()
        prompts[engine.submit(ids, params)[0]] = row
