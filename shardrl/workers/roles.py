"""Engine options for each role, read from the config in one place (actor, ref and critic share the code)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardrl.algos import ClipRange
from shardrl.rollout.request import SamplingParams
from shardrl.rollout.runner import EngineConfig
from shardrl.trainer.config import ActorConfig, CriticConfig, MegatronConfig, OptimConfig, PPOConfig
from shardrl.trainer.plan import MicroBatching
from shardrl.workers.actor import PolicyLossOptions
from shardrl.models.checkpoint import load_model_from_dist
from shardrl.models.config import ModelConfig
from shardrl.parallel.layout import Layout
from shardrl.workers.engine import EngineOptions, ModelEngine, OptimOptions, UpdateOptions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def recompute_enabled(megatron: MegatronConfig, gradient_checkpointing: bool) -> bool:
    """Full per-layer recompute: `model.enable_gradient_checkpointing`, or Megatron's `recompute_granularity`
    given through `override_transformer_config` (the key verl users set)."""
    override = megatron.override_transformer_config
    return gradient_checkpointing or override.get("recompute_granularity") in ("full", "selective")


def optim_options(optim: OptimConfig, clip_grad: float, distributed: bool, total_steps: int) -> OptimOptions:
    steps = optim.total_training_steps if optim.total_training_steps > 0 else total_steps
    return OptimOptions(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, clip_grad=clip_grad,
                        distributed=distributed, total_steps=max(steps, 1), warmup_steps=optim.lr_warmup_steps,
                        warmup_ratio=optim.lr_warmup_steps_ratio, decay_style=optim.lr_decay_style,
                        min_lr_ratio=optim.min_lr_ratio)


def engine_options(megatron: MegatronConfig, gradient_checkpointing: bool, optim: OptimOptions | None,
                   value_head: bool = False) -> EngineOptions:
    override = megatron.override_transformer_config
    return EngineOptions(
        sequence_parallel=megatron.sequence_parallel, recompute=recompute_enabled(megatron, gradient_checkpointing),
        dtype=DTYPES[megatron.dtype], value_head=value_head, optim=optim,
        moe_aux_loss_coef=float(override.get("moe_aux_loss_coeff", 0.0)),
        moe_z_loss_coef=float(override.get("moe_z_loss_coeff", 0.0) or 0.0))


def actor_engine_options(config: PPOConfig, total_steps: int) -> EngineOptions:
    actor: ActorConfig = config.actor_rollout_ref.actor
    optim = optim_options(actor.optim, actor.clip_grad_norm, actor.megatron.use_distributed_optimizer, total_steps)
    return engine_options(actor.megatron, config.actor_rollout_ref.model.enable_gradient_checkpointing, optim)


def critic_engine_options(config: PPOConfig, total_steps: int) -> EngineOptions:
    critic: CriticConfig = config.critic
    optim = optim_options(critic.optim, critic.clip_grad_norm, critic.megatron.use_distributed_optimizer,
                          total_steps)
    return engine_options(critic.megatron, critic.model.enable_gradient_checkpointing, optim, value_head=True)


def policy_loss_options(config: PPOConfig) -> PolicyLossOptions:
    """The actor loss; in bypass mode loss_type=reinforce replaces the surrogate and brings its own IS weights."""
    actor, correction = config.actor_rollout_ref.actor, config.algorithm.rollout_correction
    reinforce = not correction.decoupled and correction.loss_type == "reinforce"
    weighted = reinforce and correction.rollout_is is not None
    bypass_is = (correction.rollout_is, correction.rollout_is_threshold) if weighted else None
    return PolicyLossOptions(
        loss_agg_mode=actor.loss_agg_mode, loss_mode="reinforce" if reinforce else actor.policy_loss.loss_mode,
        bypass_is=bypass_is,
        clip=ClipRange(actor.clip_ratio, actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c),
        entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        max_response_length=actor.loss_scale_factor or config.actor_rollout_ref.rollout.response_length)


def update_options(batching: MicroBatching, epochs: int, shuffle: bool, seed: int) -> UpdateOptions:
    """`batching`: the plan's "update" normalisation (per-rank mini batch = ppo_mini_batch_size * n / DP)."""
    return UpdateOptions(mini_batch_size=batching.samples_per_rank, micro_batch_size=batching.micro_batch_size,
                         max_token_len=batching.max_token_len, ppo_epochs=epochs, shuffle=shuffle, seed=seed)


def build_engine(model_config: ModelConfig, layout: Layout, options: EngineOptions, megatron: MegatronConfig,
                 hf_path: str, optional_weights: Sequence[str] = ()) -> ModelEngine:
    """A role's engine with its initial weights: from `megatron.dist_checkpointing_path` when
    `use_dist_checkpointing` (converted with `python -m shardrl.models.convert hf-to-dist`), else from HF."""
    if not megatron.use_dist_checkpointing:
        return ModelEngine(model_config, layout, options, hf_path=hf_path, optional_weights=optional_weights)
    return ModelEngine(model_config, layout, options, weights_loader=lambda chunks: load_model_from_dist(
        chunks, layout, megatron.dist_checkpointing_path, optional_weights))


def offload_flags(megatron: MegatronConfig) -> dict[str, bool]:
    """What a role keeps in host memory between its calls (`shardrl.parallel.offload` keyword arguments)."""
    return dict(params=megatron.param_offload, grads=megatron.grad_offload, optimizer_state=megatron.optimizer_offload)


def rollout_engine_config(config: PPOConfig) -> EngineConfig:
    """The rollout engine of either placement (colocated with the actor, or alone on the rollout pool)."""
    rollout = config.actor_rollout_ref.rollout
    return EngineConfig(
        max_num_seqs=rollout.max_num_seqs, max_num_batched_tokens=rollout.max_num_batched_tokens,
        max_model_len=rollout.max_model_len or rollout.prompt_length + rollout.response_length,
        gpu_memory_utilization=rollout.gpu_memory_utilization, dtype=DTYPES[rollout.dtype],
        enforce_eager=rollout.enforce_eager, seed=rollout.seed, share_prefill=rollout.enable_prefix_caching)


def sampling_params(config: PPOConfig, seeds: torch.Tensor, validate: bool = False) -> list[SamplingParams]:
    """One request's settings per row (`seeds` [B]: the rows' `sample_seed`); validation samples by `val_kwargs`."""
    rollout = config.actor_rollout_ref.rollout
    sampling = rollout.val_kwargs if validate else rollout
    temperature = sampling.temperature if sampling.do_sample else 0.0
    return [SamplingParams(max_tokens=rollout.response_length, temperature=temperature, top_k=sampling.top_k,
                           top_p=sampling.top_p, ignore_eos=rollout.ignore_eos, seed=int(seed)) for seed in seeds]
