"""Actor and reference-policy work on one rank: log-probabilities and PPO updates over a `ModelEngine`.

Plain functions over an engine and a `Batch` (this rank's data-parallel share, identical on its TP/PP ranks), so
they are unit-testable without Ray; the worker classes only hold the engine and call these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shardrl.algos import ClipRange, LossScale, actor_loss
from shardrl.data.batch import Batch
from shardrl.models.transformer import Transformer
from shardrl.workers.engine import (
    MicroBatch,
    ModelEngine,
    UpdateOptions,
    make_micro_batches,
    stack_outputs,
    train_epochs,
)
from shardrl.workers.packing import unpack_responses


@dataclass
class PolicyLossOptions:
    loss_agg_mode: str = "token-mean"
    loss_mode: str = "vanilla"  # actor.policy_loss.loss_mode, or reinforce (bypass loss_type): algos.actor_loss
    bypass_is: tuple[str, float] | None = None  # reinforce's (rollout_is, threshold) vs the current policy
    clip: ClipRange = ClipRange()
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    max_response_length: int = 1


def _logprobs(chunk: Transformer, hidden: Tensor, mb: MicroBatch, temperature: float) -> tuple[Tensor, Tensor]:
    log_prob, entropy = chunk.compute_logprobs(hidden, mb.packed.targets, temperature)  # [T], [T]
    return unpack_responses(log_prob, mb.packed), unpack_responses(entropy, mb.packed)  # [b, R] each


@torch.no_grad()
def compute_log_prob(engine: ModelEngine, batch: Batch, micro_batch_size: int | None, max_token_len: int | None,
                     temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-probabilities and entropies `[B, R]` of `batch["responses"]` under the engine's current weights."""

    def loss_fn(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        log_prob, entropy = _logprobs(chunk, hidden, mb, temperature)
        return hidden.new_zeros(()), {"log_probs": log_prob, "entropy": entropy}

    micro_batches, restore = make_micro_batches(batch, (), engine.layout.device, micro_batch_size, max_token_len)
    outputs = engine.run(micro_batches, loss_fn, forward_only=True)
    return stack_outputs(outputs, "log_probs", restore).cpu(), stack_outputs(outputs, "entropy", restore).cpu()


def policy_loss_fn(options: PolicyLossOptions, scale: LossScale, temperature: float):
    """The per-micro-batch actor loss (algos.actor_loss with the mini batch's global counts)."""

    def loss_fn(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        log_prob, entropy = _logprobs(chunk, hidden, mb, temperature)
        d = mb.data
        loss, metrics = actor_loss(
            log_prob, d["old_log_probs"], d["advantages"], d["response_mask"], scale, options.loss_agg_mode,
            options.clip, is_weights=d.get("is_weights"), bypass_is=options.bypass_is, entropy=entropy,
            entropy_coeff=options.entropy_coeff, ref_log_prob=d["ref_log_prob"] if options.use_kl_loss else None,
            kl_loss_coef=options.kl_loss_coef, kl_loss_type=options.kl_loss_type, loss_mode=options.loss_mode)
        return loss, {**metrics, "log_probs": log_prob}

    return loss_fn


def update_policy(engine: ModelEngine, batch: Batch, loss: PolicyLossOptions, update: UpdateOptions,
                  temperature: float = 1.0) -> dict[str, list[float]]:
    """PPO epochs over mini batches of `batch`; one optimizer step per mini batch; metrics per step."""
    keys = ["old_log_probs", "advantages", "response_mask"]
    keys += [k for k in ("is_weights",) if k in batch.tensors.keys()]
    keys += ["ref_log_prob"] if loss.use_kl_loss else []
    return train_epochs(engine, batch, update, keys, lambda scale: policy_loss_fn(loss, scale, temperature),
                        loss.max_response_length)
