"""verl's hybrid engine: actor, optional reference policy and the rollout engine in one process per rank, each with
its own Layout over the same ranks (all from the process's one `GroupRegistry`), weights moving from actor to
rollout in-process (`ColocatedSync`).

With `rollout.free_cache_engine` the engine frees its KV cache after every generation, so training can use that
memory; the next weight sync wakes it (weights first, cache after), as does a generation that finds it asleep.
"""

from __future__ import annotations

from typing import Any

from shardrl.agents.driver import RunnerStats, build_runner
from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.controller.rank_env import collective_timeout
from shardrl.data.batch import Batch
from shardrl.job.options import ActorOptions, RefOptions, RolloutOptions
from shardrl.models.config import ModelConfig
from shardrl.parallel.layout import GroupRegistry
from shardrl.rollout.engine import Engine
from shardrl.sync.colocated import ColocatedSync
from shardrl.workers.actor import ActorRefWorker
from shardrl.workers.role_model import create_layout
from shardrl.workers.samples import generate, generate_trajectories
from shardrl.workers.stream import SampleStream


class ActorRolloutRefWorker(ActorRefWorker):
    def __init__(self, actor: ActorOptions, ref: RefOptions | None, rollout: RolloutOptions, model_path: str,
                 pad_token_id: int, registry: GroupRegistry | None = None) -> None:
        super().__init__(actor, ref, model_path, registry)
        self.rollout_options, self.pad_token_id = rollout, pad_token_id
        model_config = ModelConfig.from_pretrained(model_path, overrides=rollout.override_config)
        self.rollout = Engine(model_config, create_layout(rollout.spec, rollout.ranks, self.registry), rollout.engine)
        self.agents = None if rollout.agent is None else build_runner(self.rollout, rollout.agent)
        self.samples = SampleStream(self.rollout, self.agents, rollout.response_length, pad_token_id)
        sync = rollout.weight_sync
        self.weight_sync = ColocatedSync(self.actor.chunks, self.actor.layout, self.actor.host_buffers, self.rollout,
                                         sync.bucket_bytes, sync.verify, collective_timeout())
        self.sync_weights(0)

    @dispatch_mode(Dispatch.DP_COMPUTE, layout="rollout")
    def generate_sequences(self, prompts: Batch, validate: bool = False) -> Batch:
        """One response per row: the controller repeats each prompt `n` times (rows stay 1:1 for dispatch)."""
        o = self.rollout_options
        sampling = o.validate if validate else o.train
        self.rollout.wake_up()  # a no-op unless free_cache_engine put the cache to sleep after the last generation
        params = sampling.params(prompts.tensors["sample_seed"])
        if self.agents is None:
            samples = generate(self.rollout, prompts, params, o.response_length, self.pad_token_id)
        else:
            samples = generate_trajectories(self.agents, prompts, params, o.response_length, self.pad_token_id)
        if o.free_cache_engine:
            self.rollout.sleep()
        return samples

    @dispatch_mode(Dispatch.PER_REPLICA, layout="rollout")
    def stream_sequences(self, prompts: Batch | None, max_steps: int) -> tuple[Batch | None, dict[str, Any]]:
        """`generate_sequences` over many short calls, for a controller that acts on each sample as it finishes
        (`reward_model.use_reward_loop`): the rows of `prompts` (this replica's share; None: nothing new) join the
        engine's queue at once, as they would in one generation, and each call runs at most `max_steps` engine
        steps and returns the samples that finished meanwhile (`SampleStream.run`)."""
        o = self.rollout_options
        idle = prompts is None and not self.samples.busy()  # a call queued behind the one that finished the last
        if not idle:
            self.rollout.wake_up()  # a no-op unless free_cache_engine put the cache to sleep after the last generation
        if prompts is not None:
            self.samples.add(prompts, o.train.params(prompts.tensors["sample_seed"]), refill=False)
        finished = self.samples.run(max_steps)
        if o.free_cache_engine and not idle and not self.samples.busy():
            self.rollout.sleep()
        return finished

    @dispatch_mode(Dispatch.PER_REPLICA, layout="rollout")
    def stream(self, prompts: Batch | None, max_steps: int) -> tuple[Batch | None, dict[str, Any]]:
        """`RolloutWorker.stream` on the colocated engine (the colocated asynchronous trainer's rollouter): new rows
        wait in a backlog and enter the engine in refill chunks, and each call runs at most `max_steps` engine steps.
        The trainer pauses the stream around everything else it runs on these ranks (`pause_generation`)."""
        self.rollout.wake_up()  # a no-op unless the cache sleeps (pause_generation, free_cache_engine)
        if prompts is not None:
            self.samples.add(prompts, self.rollout_options.train.params(prompts.tensors["sample_seed"]), refill=True)
        return self.samples.run(max_steps)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def pause_generation(self) -> None:
        """Stop the requests in flight, keeping what they generated (`resume_generation` continues them, re-prefilled
        from prompt and tokens so far), and with `rollout.free_cache_engine` free the KV cache for training."""
        self.rollout.abort(keep=True)
        if self.rollout_options.free_cache_engine:
            self.rollout.sleep()

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def resume_generation(self) -> None:
        """Continue the requests `pause_generation` stopped, under whatever weights the engine holds now."""
        self.rollout.wake_up()
        self.rollout.resume()

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def take_agent_stats(self) -> RunnerStats | None:
        """The agent runner's stats since the last call (None: single turn)."""
        return None if self.agents is None else self.agents.take_stats()

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Actor -> rollout, in-process (colocated): the rollout's weights come back first, its KV cache after."""
        return self.weight_sync.sync(version)
