"""Ray-hosted worker classes. Each holds engines and calls the plain functions of actor.py / critic.py /
rollout.py; the `@dispatch_mode` marks tell the controller how to split and collect (see controller/dispatch.py).

`ActorRefWorker` is the policy being trained plus the optional reference policy: log-probs, PPO updates,
checkpoints. Every placement builds on it (the detached one in detached.py too), so batch sizes are normalised in one
place, from `plan.roles[...].batches`. Parts the config offloads (`megatron.param_offload` etc.) stay in host memory
between calls; weight sync reads offloaded params from there.

`ActorRolloutRefWorker` is verl's hybrid engine: actor, optional reference policy and the rollout engine live in one
process per rank, each with its own Layout over the same ranks, and weights move from actor to rollout in-process.

Every worker takes the process's `GroupRegistry` (`registry`; the Ray rank host passes the one all roles of its
process share) and builds all its layouts from it; without one it makes its own, for a process hosting only it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.controller.host import collective_timeout
from shardrl.data.batch import Batch
from shardrl.models.config import ModelConfig
from shardrl.models.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from shardrl.models.hf_bridge import save_hf_checkpoint
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.offload import offload, on_device
from shardrl.rollout.engine import Engine
from shardrl.sync.colocated import ColocatedSync
from shardrl.trainer.config import MegatronConfig, PPOConfig
from shardrl.trainer.plan import Plan
from shardrl.workers import actor, critic, roles
from shardrl.workers.engine import ModelEngine
from shardrl.workers.rollout import generate


def _layout(plan: Plan, role: str, registry: GroupRegistry | None) -> Layout:
    role_plan = plan.roles[role]
    return Layout.create(role_plan.spec, role_plan.ranks, timeout=collective_timeout(), registry=registry)


def _unpadded_rows(batch: Batch) -> Batch:
    """Drop the controller's DP padding rows (copies of real samples) before anything that counts samples."""
    return batch.unpad() if batch.meta.get("num_pad") else batch


def _offload(engine: ModelEngine, megatron: MegatronConfig) -> None:
    flags = roles.offload_flags(megatron)
    if any(flags.values()):
        offload(engine.chunks, engine.optimizer, **flags)


@contextmanager
def _resident(engine: ModelEngine, megatron: MegatronConfig) -> Iterator[None]:
    """The engine's offloaded parts on the device for the body, back in host memory after it."""
    flags = roles.offload_flags(megatron)
    if not any(flags.values()):
        yield
        return
    with on_device(engine.chunks, engine.optimizer, **flags):
        yield


class ActorRefWorker:
    def __init__(self, config: PPOConfig, plan: Plan, model_path: str, total_steps: int, pad_token_id: int,
                 registry: GroupRegistry | None = None) -> None:
        torch.manual_seed(config.trainer.seed)
        self.config, self.plan, self.pad_token_id = config, plan, pad_token_id
        self.registry = GroupRegistry() if registry is None else registry  # actor, ref and rollout layouts share it
        arr = config.actor_rollout_ref
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.model_path = model_path
        self.actor = roles.build_engine(self.model_config, _layout(plan, "actor", self.registry),
                                        roles.actor_engine_options(config, total_steps), arr.actor.megatron, model_path)
        _offload(self.actor, arr.actor.megatron)
        self.ref = None
        if "ref" in plan.roles:
            ref_options = roles.engine_options(arr.ref.megatron, False, None)
            self.ref = roles.build_engine(self.model_config, _layout(plan, "ref", self.registry), ref_options,
                                          arr.ref.megatron, model_path)
            _offload(self.ref, arr.ref.megatron)

    def _actor_resident(self):
        return _resident(self.actor, self.config.actor_rollout_ref.actor.megatron)

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        b = self.plan.roles["actor"].batches["log_prob"]
        temperature = self.config.actor_rollout_ref.rollout.temperature or 1.0
        with self._actor_resident():
            log_probs, entropy = actor.compute_log_prob(self.actor, batch, b.micro_batch_size, b.max_token_len,
                                                        temperature)
        return Batch({"old_log_probs": log_probs, "entropy": entropy})

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        b = self.plan.roles["ref"].batches["log_prob"]
        temperature = self.config.actor_rollout_ref.rollout.temperature or 1.0
        with _resident(self.ref, self.config.actor_rollout_ref.ref.megatron):
            log_probs, _ = actor.compute_log_prob(self.ref, batch, b.micro_batch_size, b.max_token_len, temperature)
        return Batch({"ref_log_prob": log_probs})

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch, step: int) -> dict[str, list[float]]:
        arr = self.config.actor_rollout_ref
        update = roles.update_options(self.plan.roles["actor"].batches["update"], arr.actor.ppo_epochs,
                                      arr.actor.shuffle, self.config.trainer.seed + step)
        temperature = arr.rollout.temperature or 1.0
        with self._actor_resident():
            return actor.update_policy(self.actor, _unpadded_rows(batch), roles.policy_loss_options(self.config),
                                       update, temperature)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> None:
        with self._actor_resident():
            save_checkpoint(checkpoint_dir(root, step) / "actor", self.actor.chunks, self.actor.layout,
                            optimizer=self.actor.optimizer, scheduler=self.actor.scheduler,
                            trainer_state=trainer_state, hf_dir=self.model_path)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, step_dir: str) -> dict:
        """Restore the actor (weights, optimizer, schedule, RNG); the controller syncs the rollout after it."""
        with self._actor_resident():
            return load_checkpoint(Path(step_dir) / "actor", self.actor.chunks, self.actor.layout,
                                   optimizer=self.actor.optimizer, scheduler=self.actor.scheduler)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def save_hf(self, out_dir: str) -> None:
        """The actor as an HF checkpoint transformers loads (collective; the layout's first rank writes)."""
        with self._actor_resident():
            save_hf_checkpoint(self.actor.chunks, self.actor.layout, out_dir)


class ActorRolloutRefWorker(ActorRefWorker):
    def __init__(self, config: PPOConfig, plan: Plan, model_path: str, total_steps: int, pad_token_id: int,
                 registry: GroupRegistry | None = None) -> None:
        super().__init__(config, plan, model_path, total_steps, pad_token_id, registry)
        self.rollout = Engine(self.model_config, _layout(plan, "rollout", self.registry),
                              roles.rollout_engine_config(config))
        weight_sync = config.actor_rollout_ref.rollout.weight_sync
        self.weight_sync = ColocatedSync(self.actor, self.rollout, weight_sync.bucket_size_mb << 20,
                                         weight_sync.verify, collective_timeout())
        self.sync_weights(0)

    @dispatch_mode(Dispatch.DP_COMPUTE, layout="rollout")
    def generate_sequences(self, prompts: Batch, validate: bool = False) -> Batch:
        """One response per row: the controller repeats each prompt `n` times (rows stay 1:1 for dispatch)."""
        params = roles.sampling_params(self.config, prompts.tensors["sample_seed"], validate)
        return generate(self.rollout, prompts, params, self.config.actor_rollout_ref.rollout.response_length,
                        self.pad_token_id)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Actor -> rollout, in-process (colocated): the rollout's weights come back first, its KV cache after."""
        return self.weight_sync.sync(version)


class CriticWorker:
    def __init__(self, config: PPOConfig, plan: Plan, model_path: str, total_steps: int,
                 registry: GroupRegistry | None = None) -> None:
        torch.manual_seed(config.trainer.seed)
        self.config, self.plan, self.model_path = config, plan, model_path
        self.critic = roles.build_engine(ModelConfig.from_pretrained(model_path), _layout(plan, "critic", registry),
                                         roles.critic_engine_options(config, total_steps), config.critic.megatron,
                                         model_path, optional_weights=("score.weight",))
        _offload(self.critic, config.critic.megatron)

    def _resident(self):
        return _resident(self.critic, self.config.critic.megatron)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> None:
        with self._resident():
            save_checkpoint(checkpoint_dir(root, step) / "critic", self.critic.chunks, self.critic.layout,
                            optimizer=self.critic.optimizer, scheduler=self.critic.scheduler, rng=False)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, step_dir: str) -> None:
        with self._resident():
            load_checkpoint(Path(step_dir) / "critic", self.critic.chunks, self.critic.layout,
                            optimizer=self.critic.optimizer, scheduler=self.critic.scheduler, restore_rng=False)

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        b = self.plan.roles["critic"].batches["values"]
        with self._resident():
            values = critic.compute_values(self.critic, batch, b.micro_batch_size, b.max_token_len)
        return Batch({"values": values})

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch, step: int) -> dict[str, list[float]]:
        c = self.config.critic
        update = roles.update_options(self.plan.roles["critic"].batches["update"], c.ppo_epochs, c.shuffle,
                                      self.config.trainer.seed + step)
        with self._resident():
            return critic.update_critic(self.critic, _unpadded_rows(batch), update, c.loss_agg_mode,
                                        c.cliprange_value, self.config.actor_rollout_ref.rollout.response_length)
