"""Critic work on one rank: values and value-loss updates over a value-head `ModelEngine` (plain functions, see
actor.py), and `CriticWorker`, which holds the engine and calls them with its `CriticOptions`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor

from shardrl.algos import LossScale, value_loss
from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.data.batch import Batch
from shardrl.job.options import CriticOptions, ForwardBatching, UpdateOptions
from shardrl.models.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import GroupRegistry
from shardrl.workers.engine import MicroBatch, ModelEngine, make_micro_batches, stack_outputs, train_epochs
from shardrl.workers.packing import unpack_responses
from shardrl.workers.role_model import build_engine, resident, unpadded_rows


def _values(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> Tensor:
    """V(s) at the position *predicting* each response token, i.e. the state before it was sampled: [b, R]."""
    return unpack_responses(chunk.compute_values(hidden, mb.packed.num_tokens).float(), mb.packed)


@torch.no_grad()
def compute_values(engine: ModelEngine, batch: Batch, batching: ForwardBatching) -> Tensor:
    def loss_fn(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return hidden.new_zeros(()), {"values": _values(chunk, hidden, mb)}

    micro_batches, restore = make_micro_batches(batch, (), engine.layout.device, batching.micro_batch_size,
                                                batching.max_token_len,
                                                count_group=engine.count_group)
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


class CriticWorker:
    def __init__(self, options: CriticOptions, model_path: str, registry: GroupRegistry | None = None) -> None:
        torch.manual_seed(options.seed)
        self.options = options
        self.critic = build_engine(options.model, model_path, registry, optional_weights=("score.weight",))

    def _resident(self):
        return resident(self.critic, self.options.model)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> None:
        with self._resident():
            save_checkpoint(checkpoint_dir(root, step) / "critic", self.critic.chunks, self.critic.layout,
                            optimizer=self.critic.optimizer, scheduler=self.critic.scheduler, rng=False,
                            contents=self.options.checkpoint.save_contents)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, step_dir: str) -> None:
        with self._resident():
            load_checkpoint(Path(step_dir) / "critic", self.critic.chunks, self.critic.layout,
                            optimizer=self.critic.optimizer, scheduler=self.critic.scheduler, restore_rng=False,
                            contents=self.options.checkpoint.load_contents)

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        with self._resident():
            values = compute_values(self.critic, batch, self.options.values)
        return Batch({"values": values})

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch, step: int) -> dict[str, list[float]]:
        o = self.options
        update = dataclasses.replace(o.update, seed=o.update.seed + step)
        with self._resident():
            return update_critic(self.critic, unpadded_rows(batch), update, o.loss_agg_mode, o.cliprange_value,
                                 o.max_response_length)
