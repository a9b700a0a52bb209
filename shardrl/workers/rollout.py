"""The rollout pool's worker in the detached placement (the async modes).

`RolloutWorker` builds only its own layout and the weight-sync group, nothing of the trainer's TP x PP x EP, so a
rollout pool need not fit the trainer's layout. Its engine serves in two ways: `generate_sequences` (a whole batch,
as the colocated worker) and `stream` (requests added and finished samples returned over many short calls: the
async modes' rollouter, workers/stream.py). Every call is SPMD over a replica's TP ranks, which get the same
arguments, so the ranks of a replica stay in lockstep without coordinating among themselves.
"""

from __future__ import annotations

from typing import Any

import torch

from shardrl.agents.driver import RunnerStats, build_runner
from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.controller.rank_env import collective_timeout
from shardrl.data.batch import Batch
from shardrl.job.options import RolloutOptions
from shardrl.models.config import ModelConfig
from shardrl.parallel.layout import GroupRegistry
from shardrl.rollout.engine import Engine
from shardrl.sync.detached import DetachedSync
from shardrl.workers.role_model import create_layout
from shardrl.workers.samples import generate, generate_trajectories
from shardrl.workers.stream import SampleStream


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
        self.weight_sync = DetachedSync.receiver(self.engine, group, sync.bucket_bytes, sync.verify,
                                                 collective_timeout())
        self.agents = None if options.agent is None else build_runner(self.engine, options.agent)
        self.samples = SampleStream(self.engine, self.agents, self.response_length, pad_token_id)  # `stream`'s

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
    def stream(self, prompts: Batch | None, max_steps: int) -> tuple[Batch | None, dict[str, Any]]:
        """Take one request per row of `prompts` (None: nothing new), run at most `max_steps` engine steps and
        return the samples that finished meanwhile, whichever call queued them (`SampleStream.run`). New requests
        wait in a backlog and enter the engine in refill chunks (`stream.admit`). Multi-turn: each row is a
        trajectory of the agent runner, which queues its turns in the engine itself; a trajectory paused by a
        weight sync continues under the new weights."""
        if prompts is not None:
            self.samples.add(prompts, self.options.train.params(prompts.tensors["sample_seed"]), refill=True)
        return self.samples.run(max_steps)

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

