"""Ray-hosted worker classes. Each holds engines and calls the plain functions of actor.py / critic.py /
rollout.py; the `@dispatch_mode` marks tell the controller how to split and collect (see controller/dispatch.py).

`ActorRolloutRefWorker` is verl's hybrid engine: actor, optional reference policy and the rollout engine live in one
process per rank, each with its own Layout over the same ranks, and weights move from actor to rollout in-process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.controller.host import collective_timeout
from shardrl.data.batch import Batch
from shardrl.models.config import ModelConfig
from shardrl.models.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from shardrl.models.hf_bridge import save_hf_checkpoint
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine
from shardrl.rollout.request import SamplingParams
from shardrl.rollout.runner import EngineConfig
from shardrl.sync.colocated import ColocatedSync
from shardrl.trainer.config import PPOConfig
from shardrl.trainer.plan import Plan
from shardrl.workers import actor, critic, roles
from shardrl.workers.rollout import generate


def _layout(plan: Plan, role: str) -> Layout:
    role_plan = plan.roles[role]
    return Layout.create(role_plan.spec, role_plan.ranks, timeout=collective_timeout())


def _unpadded_rows(batch: Batch) -> Batch:
    """Drop the controller's DP padding rows (copies of real samples) before anything that counts samples."""
    return batch.unpad() if batch.meta.get("num_pad") else batch


class ActorRolloutRefWorker:
    def __init__(self, config: PPOConfig, plan: Plan, model_path: str, total_steps: int, pad_token_id: int) -> None:
        torch.manual_seed(config.trainer.seed)
        self.config, self.plan, self.pad_token_id = config, plan, pad_token_id
        arr = config.actor_rollout_ref
        model_config = ModelConfig.from_pretrained(model_path)
        self.model_path = model_path
        self.actor = roles.build_engine(model_config, _layout(plan, "actor"), roles.actor_engine_options(
            config, total_steps), arr.actor.megatron, model_path)
        self.ref = None
        if "ref" in plan.roles:
            ref_options = roles.engine_options(arr.ref.megatron, False, None)
            self.ref = roles.build_engine(model_config, _layout(plan, "ref"), ref_options, arr.ref.megatron,
                                          model_path)
        rollout = arr.rollout
        engine_config = EngineConfig(
            max_num_seqs=rollout.max_num_seqs, max_num_batched_tokens=rollout.max_num_batched_tokens,
            max_model_len=rollout.max_model_len or rollout.prompt_length + rollout.response_length,
            gpu_memory_utilization=rollout.gpu_memory_utilization, dtype=roles.DTYPES[rollout.dtype],
            enforce_eager=rollout.enforce_eager, seed=rollout.seed)
        self.rollout = Engine(model_config, _layout(plan, "rollout"), engine_config)
        self.weight_sync = ColocatedSync(self.actor, self.rollout, rollout.weight_sync.bucket_size_mb << 20,
                                         rollout.weight_sync.verify, collective_timeout())
        self.sync_weights()

    @dispatch_mode(Dispatch.DP_COMPUTE, layout="rollout")
    def generate_sequences(self, prompts: Batch, validate: bool = False) -> Batch:
        """One response per row: the controller repeats each prompt `n` times (rows stay 1:1 for dispatch)."""
        rollout = self.config.actor_rollout_ref.rollout
        sampling = rollout.val_kwargs if validate else rollout
        temperature = sampling.temperature if sampling.do_sample else 0.0
        params = [SamplingParams(max_tokens=rollout.response_length, temperature=temperature, top_k=sampling.top_k,
                                 top_p=sampling.top_p, ignore_eos=rollout.ignore_eos, seed=int(seed))
                  for seed in prompts.tensors["sample_seed"]]
        return generate(self.rollout, prompts, params, rollout.response_length, self.pad_token_id)

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        b = self.plan.roles["actor"].batches["log_prob"]
        temperature = self.config.actor_rollout_ref.rollout.temperature or 1.0
        log_probs, entropy = actor.compute_log_prob(self.actor, batch, b.micro_batch_size, b.max_token_len,
                                                    temperature)
        return Batch({"old_log_probs": log_probs, "entropy": entropy})

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        b = self.plan.roles["ref"].batches["log_prob"]
        temperature = self.config.actor_rollout_ref.rollout.temperature or 1.0
        log_probs, _ = actor.compute_log_prob(self.ref, batch, b.micro_batch_size, b.max_token_len, temperature)
        return Batch({"ref_log_prob": log_probs})

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch, step: int) -> dict[str, list[float]]:
        arr = self.config.actor_rollout_ref
        update = roles.update_options(self.plan.roles["actor"].batches["update"], arr.actor.ppo_epochs,
                                      arr.actor.shuffle, self.config.trainer.seed + step)
        temperature = arr.rollout.temperature or 1.0
        return actor.update_policy(self.actor, _unpadded_rows(batch), roles.policy_loss_options(self.config),
                                   update, temperature)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Actor -> rollout, in-process (colocated): the rollout's weights come back first, its KV cache after."""
        return self.weight_sync.sync(version)


    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> None:
        save_checkpoint(checkpoint_dir(root, step) / "actor", self.actor.chunks, self.actor.layout,
                        optimizer=self.actor.optimizer, scheduler=self.actor.scheduler, trainer_state=trainer_state,
                        hf_dir=self.model_path)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, step_dir: str) -> dict:
        """Restore the actor (weights, optimizer, schedule, RNG) and push its weights to the rollout engine."""
        state = load_checkpoint(Path(step_dir) / "actor", self.actor.chunks, self.actor.layout,
                                optimizer=self.actor.optimizer, scheduler=self.actor.scheduler)
        self.sync_weights(state["policy_version"])
        return state

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def save_hf(self, out_dir: str) -> None:
        """The actor as an HF checkpoint transformers loads (collective; the layout's first rank writes)."""
        save_hf_checkpoint(self.actor.chunks, self.actor.layout, out_dir)


class CriticWorker:
    def __init__(self, config: PPOConfig, plan: Plan, model_path: str, total_steps: int) -> None:
        torch.manual_seed(config.trainer.seed)
        self.config, self.plan, self.model_path = config, plan, model_path
        self.critic = roles.build_engine(ModelConfig.from_pretrained(model_path), _layout(plan, "critic"),
                                         roles.critic_engine_options(config, total_steps), config.critic.megatron,
                                         model_path, optional_weights=("score.weight",))

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> None:
        save_checkpoint(checkpoint_dir(root, step) / "critic", self.critic.chunks, self.critic.layout,
                        optimizer=self.critic.optimizer, scheduler=self.critic.scheduler, rng=False)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, step_dir: str) -> None:
        load_checkpoint(Path(step_dir) / "critic", self.critic.chunks, self.critic.layout,
                        optimizer=self.critic.optimizer, scheduler=self.critic.scheduler, restore_rng=False)

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        b = self.plan.roles["critic"].batches["values"]
        return Batch({"values": critic.compute_values(self.critic, batch, b.micro_batch_size, b.max_token_len)})

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch, step: int) -> dict[str, list[float]]:
        c = self.config.critic
        update = roles.update_options(self.plan.roles["critic"].batches["update"], c.ppo_epochs, c.shuffle,
                                      self.config.trainer.seed + step)
        return critic.update_critic(self.critic, _unpadded_rows(batch), update, c.loss_agg_mode, c.cliprange_value,
                                    self.config.actor_rollout_ref.rollout.response_length)
