"""Critic work on one rank: values and value-loss updates over a value-head `ModelEngine` (see actor.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from shardrl.algos import LossScale, value_loss
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


def _values(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> Tensor:
    """V(s) at the position *predicting* each response token, i.e. the state before it was sampled: [b, R]."""
    return unpack_responses(chunk.compute_values(hidden, mb.packed.num_tokens).float(), mb.packed)


@torch.no_grad()
def compute_values(engine: ModelEngine, batch: Batch, micro_batch_size: int | None,
                   max_token_len: int | None) -> Tensor:
    def loss_fn(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return hidden.new_zeros(()), {"values": _values(chunk, hidden, mb)}

    micro_batches, restore = make_micro_batches(batch, (), engine.layout.device, micro_batch_size, max_token_len)
    outputs = engine.run(micro_batches, loss_fn, forward_only=True)
    return stack_outputs(outputs, "values", restore).cpu()


def update_critic(engine: ModelEngine, batch: Batch, update: UpdateOptions, loss_agg_mode: str,
                  cliprange_value: float, max_response_length: int) -> dict[str, list[float]]:
    def make_loss_fn(scale: LossScale):
        def loss_fn(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
            d = mb.data
            return value_loss(_values(chunk, hidden, mb), d["values"], d["returns"], d["response_mask"], scale,
                              loss_agg_mode, cliprange_value)
        return loss_fn

    return train_epochs(engine, batch, update, ["values", "returns", "response_mask"], make_loss_fn,
                        max_response_length)
