"""Pipeline parallelism: which layers a stage owns, and the forward/backward schedule over micro batches.

Contract for the model and the trainer
--------------------------------------
*Stages.* With ``PP`` pipeline ranks and ``VPP`` virtual chunks per rank, chunk ``c`` of pipeline rank ``r`` is
virtual stage ``v = c * PP + r`` and owns layers ``stage_layer_ids(L, PP, VPP, r, c)`` (a contiguous block of
``L / (PP*VPP)`` layers; ``v`` increases with depth). ``chunk_pre_post(PP, VPP, r, c)`` says whether the chunk is the
first virtual stage (it embeds the tokens: ``pre_process``) and/or the last (LM head / value head: ``post_process``).
A rank builds one module per chunk, in chunk order.

*Steps.* `forward_backward` knows nothing about transformers; the caller supplies two functions:

* ``forward_step(chunk_module, micro_batch, x) -> y``: runs one chunk. ``x`` is None on the first virtual stage
  (read the tokens from ``micro_batch``) and the previous stage's output otherwise. Tensors of any shape and dtype
  may pass between stages and may differ per micro batch (packed sequences of different lengths). A chunk with
  losses of its own (MoE load-balancing / z-loss) returns ``(y, aux_loss)`` instead: the scalar ``aux_loss`` is
  backpropagated together with ``y`` on whatever stage the chunk sits, and is not part of the returned ``"loss"``.
* ``loss_step(y, micro_batch) -> (loss, outputs)``: runs on the last virtual stage only. ``loss`` is a scalar that
  is backpropagated *as is* (the schedule never divides by the micro-batch count: losses are already normalised by
  global counts, see DESIGN.md); ``outputs`` is a dict of tensors on the layout's device (logprobs, values, metrics).

`forward_backward` returns, per micro batch in order, ``{"loss": loss.detach(), **outputs}`` (detached) on the last
pipeline stage, and ``[]`` on the other stages unless ``broadcast_outputs=True``, which delivers the same list to
every rank of the PP group (so any rank, e.g. TP rank 0 of stage 0, can collect). Gradients accumulate into the
chunks' ``.grad`` (call ``zero_grad`` yourself). With ``forward_only=True`` everything runs under
``torch.no_grad()`` and no activations are kept.

Every rank of a PP group must call it with the same number of micro batches; activations sent between stages
must be floating point when training (the receiver asks for their gradient). Reducing gradients (DP, TP, the tied
embedding across first and last stage) is left to the caller, after the call.

Schedules: 1F1B for VPP=1 (warm-up of ``PP - rank - 1`` forwards; at most ``PP - rank`` micro batches' activations
alive), interleaved 1F1B for VPP>1 (the micro-batch count must be a multiple of PP; forward-only takes any count),
and a plain loop with gradient accumulation for PP=1. The plans live in `schedules.py`, the messages in `p2p.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from shardrl.parallel.layout import Layout
from shardrl.parallel.p2p import StageLink, broadcast_dicts
from shardrl.parallel.schedules import Action, Message, ScheduleError, Step, plan

ForwardStep = Callable[[nn.Module, Any, Tensor | None], Tensor | tuple[Tensor, Tensor]]
LossStep = Callable[[Tensor, Any], tuple[Tensor, dict[str, Tensor]]]


def stage_layer_ids(num_layers: int, pp_size: int, vpp_size: int, pp_rank: int, chunk: int) -> range:
    """Transformer layers owned by `chunk` of pipeline rank `pp_rank` (virtual stage ``chunk * PP + pp_rank``)."""
    num_stages = pp_size * vpp_size
    if num_layers % num_stages:
        raise ScheduleError(
            f"num_hidden_layers={num_layers} is not divisible by PP*VPP = {pp_size}*{vpp_size}; "
            f"choose pipeline sizes whose product divides the layer count"
        )
    per_stage = num_layers // num_stages
    stage = chunk * pp_size + pp_rank
    return range(stage * per_stage, (stage + 1) * per_stage)


def chunk_pre_post(pp_size: int, vpp_size: int, pp_rank: int, chunk: int) -> tuple[bool, bool]:
    """(is the first virtual stage, is the last virtual stage) for `chunk` of `pp_rank`."""
    return (chunk == 0 and pp_rank == 0, chunk == vpp_size - 1 and pp_rank == pp_size - 1)


def forward_backward(
    chunks: list[nn.Module],
    micro_batches: list[Any],
    layout: Layout,
    forward_step: ForwardStep,
    loss_step: LossStep,
    forward_only: bool = False,
    broadcast_outputs: bool = False,
) -> list[dict[str, Tensor]]:
    """Run every micro batch through this rank's `chunks` (forward, and backward unless `forward_only`).

    Collective over the layout's PP group: every stage calls it with the same number of micro batches.
    See the module docstring for the contract of the two step functions and of the result.
    """
    if len(chunks) != layout.spec.vpp:
        raise ScheduleError(f"got {len(chunks)} model chunks on this rank but the layout has VPP={layout.spec.vpp}")
    steps = plan(layout.pp_size, layout.spec.vpp, len(micro_batches), forward_only)[layout.pp_rank]
    run = _Run(chunks, micro_batches, layout, forward_step, loss_step, forward_only)
    with torch.no_grad() if forward_only else nullcontext():
        for step in steps:
            run.step(step)
    outputs = [run.outputs[m] for m in range(len(micro_batches))] if layout.is_last_stage else None
    if broadcast_outputs:
        return broadcast_dicts(outputs, layout)
    return outputs or []


class _Run:
    """State of one `forward_backward` call on one rank: activations waiting for their forward or backward."""

    def __init__(self, chunks: list[nn.Module], micro_batches: list[Any], layout: Layout,
                 forward_step: ForwardStep, loss_step: LossStep, forward_only: bool) -> None:
        self.chunks, self.micro_batches = chunks, micro_batches
        self.forward_step, self.loss_step, self.forward_only = forward_step, loss_step, forward_only
        self.pp_size, self.pp_rank, self.vpp_size = layout.pp_size, layout.pp_rank, layout.spec.vpp
        self.link = StageLink(layout)
        self.inputs: dict[tuple[int, int], Tensor] = {}  # (chunk, micro batch) -> received activation
        self.grads: dict[tuple[int, int], Tensor] = {}  # (chunk, micro batch) -> received grad of our output
        # (chunk, micro batch) -> (input or None, output or loss, aux loss or None) kept for the backward; freed by it.
        self.saved: dict[tuple[int, int], tuple[Tensor | None, Tensor, Tensor | None]] = {}
        self.outputs: dict[int, dict[str, Tensor]] = {}

    def step(self, step: Step) -> None:
        """Run this tick's action, then swap messages with the neighbours."""
        outgoing = None
        if step.action is not None:
            outgoing = self._forward(step.action) if step.action.kind == "F" else self._backward(step.action)
        if not (step.sends or step.recvs):
            return
        sends = [(msg, outgoing) for msg in step.sends]  # an action produces at most one message
        known = [None if msg.kind == "F" else self._output_meta(msg) for msg in step.recvs]
        received = self.link.exchange(sends, list(zip(step.recvs, known)))
        for msg, tensor in zip(step.recvs, received):
            (self.inputs if msg.kind == "F" else self.grads)[(msg.chunk, msg.micro_batch)] = tensor

    def _output_meta(self, msg: Message) -> tuple[torch.Size, torch.dtype]:
        output = self.saved[(msg.chunk, msg.micro_batch)][1]  # a gradient has its activation's shape and dtype
        return output.shape, output.dtype

    def _forward(self, action: Action) -> Tensor | None:
        """Forward one chunk; returns the activation for the next stage (None on the last virtual stage)."""
        first, last = chunk_pre_post(self.pp_size, self.vpp_size, self.pp_rank, action.chunk)
        key = (action.chunk, action.micro_batch)
        micro_batch = self.micro_batches[action.micro_batch]
        x = None if first else self.inputs.pop(key)
        if x is not None and not self.forward_only:
            x.requires_grad_()
        y = self.forward_step(self.chunks[action.chunk], micro_batch, x)
        y, aux_loss = y if isinstance(y, tuple) else (y, None)
        if last:
            loss, outputs = self.loss_step(y, micro_batch)
            self.outputs[action.micro_batch] = _detached(loss, outputs)
            y = loss
        if not self.forward_only:
            self.saved[key] = (x, y, aux_loss)
        return None if last else y

    def _backward(self, action: Action) -> Tensor | None:
        """Backward one chunk; returns the gradient of its input for the previous stage (None on the first)."""
        first, last = chunk_pre_post(self.pp_size, self.vpp_size, self.pp_rank, action.chunk)
        key = (action.chunk, action.micro_batch)
        x, y, aux_loss = self.saved.pop(key)
        outputs, grads = [y], [None if last else self.grads.pop(key)]  # None: y is the (scalar) loss
        if aux_loss is not None:
            outputs.append(aux_loss)
            grads.append(None)
        torch.autograd.backward(outputs, grad_tensors=grads)
        if first:
            return None
        # A stage whose output ignores its input still owes the previous stage a gradient: zero is the true one.
        return x.grad if x.grad is not None else torch.zeros_like(x)


def _detached(loss: Tensor, outputs: dict[str, Tensor]) -> dict[str, Tensor]:
    if "loss" in outputs:
        raise ScheduleError("loss_step's outputs dict may not use the key 'loss': the schedule adds the loss there")
    for key, value in outputs.items():
        if not isinstance(value, Tensor):
            raise ScheduleError(f"loss_step's outputs[{key!r}] is a {type(value).__name__}; return tensors only")
    return {"loss": loss.detach(), **{key: value.detach() for key, value in outputs.items()}}
