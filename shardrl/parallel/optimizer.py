"""AdamW over fp32 master weights, optionally sharded over data parallel, with global grad-norm clipping and LR
schedules.

* Master weights and both Adam moments are flat fp32 tensors laid out like the gradient buffers (data.py). Without
  the distributed optimizer every rank keeps all of them; with it (``distributed=True``) each rank keeps only its
  1/dp chunk of every bucket (dense params: over ``"dp_cp"``, experts: over ``"edp"``), gets only that chunk of the
  reduced gradient (reduce-scatter), updates it, and all-gathers the updated values into the model's params. Both
  modes compute the same numbers: the update is elementwise and the grad norm is computed identically.
* The update is torch's AdamW, run by its fused kernel: decoupled weight decay ``p *= 1 - lr * wd`` (skipped for
  params whose HF tensor is 1-D: norms, biases), bias-corrected moments, ``eps`` added after the square root.
* `step()` finalises the gradients if the caller has not, clips them by the global norm (every element of the whole
  model counted once, see `GradBuffers.global_norm`) and skips the update when the norm is not finite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from shardrl.parallel.collectives import all_gather_single
from shardrl.parallel.data import GradBuffer, GradBuffers
from shardrl.parallel.layout import Layout
from shardrl.parallel.spec import get_spec

# The largest piece of state one update passes to torch's multi-tensor kernel: joined buckets stay below 2**31
# elements, so no piece depends on that kernel's indexing past 32 bits (an expert buffer at EP 1 can exceed it).
MAX_PIECE_ELEMENTS = 2**30


def _copy_all(params: list[Tensor], sources: list[Tensor]) -> None:
    """params[i] <- sources[i] (cast to the param's dtype) in one multi-tensor copy; empties both lists."""
    if params:
        torch._foreach_copy_(params, sources)
    params.clear()
    sources.clear()


@dataclass
class _State:
    """Owned fp32 state of one gradient buffer: its owned chunks of every bucket, back to back."""

    master: Tensor  # [owned numel]
    exp_avg: Tensor  # [owned numel]
    exp_avg_sq: Tensor  # [owned numel]


class AdamW:
    """AdamW for shardrl models (see the module docstring). `lr` is set by `LRScheduler` each step."""

    def __init__(self, params: Iterable[nn.Parameter], layout: Layout, *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 clip_grad: float | None = 1.0, distributed: bool = False, bucket_mb: float = 40.0) -> None:
        self.layout = layout
        self.grads = GradBuffers(params, layout, bucket_mb=bucket_mb, shard=distributed)
        self.lr, self.betas, self.eps = lr, tuple(betas), eps
        self.weight_decay, self.clip_grad = weight_decay, clip_grad
        self.num_steps = 0  # updates applied (skipped steps do not count): Adam's bias correction step
        self.states = [self._init_state(buf) for buf in self.grads.buffers]

    @torch.no_grad()
    def _init_state(self, buf: GradBuffer) -> _State:
        _, count = self.grads.owner(buf)
        numel = sum(end - start for start, end in buf.buckets) // count
        master = torch.zeros(numel, dtype=torch.float32, device=buf.data.device)
        self._fill_master(buf, master)
        return _State(master, torch.zeros_like(master), torch.zeros_like(master))

    def _fill_master(self, buf: GradBuffer, master: Tensor) -> None:
        """master <- this rank's owned part of `buf`'s params (in fp32)."""
        for param, lo, hi, pos in self.grads.fragments(buf):
            master[pos:pos + hi - lo] = param.detach().reshape(-1)[lo:hi]

    @torch.no_grad()
    def copy_params_to_master(self) -> None:
        """Take the master weights from the model's params again, as at construction; moments and step count stay.
        For params set behind the optimizer's back (a checkpoint's weights loaded without its optimizer state): the
        next update would otherwise start from, and publish, the old master values."""
        for buf, state in zip(self.grads.buffers, self.states):
            self._fill_master(buf, state.master)

    def zero_grad(self) -> None:
        self.grads.zero()

    @torch.no_grad()
    def step(self) -> tuple[float, bool]:
        """Finalise, clip and apply one update. Returns (global grad norm before clipping, skipped)."""
        self.grads.finalize()
        grad_norm = self.grads.global_norm().item()  # the step's one host read: a non-finite norm skips the update
        if not math.isfinite(grad_norm):
            return grad_norm, True
        scale = 1.0
        if self.clip_grad is not None and self.clip_grad > 0:
            scale = min(1.0, self.clip_grad / (grad_norm + 1e-6))
        self.num_steps += 1
        self._update(*self._owned_pieces(), clip_scale=scale)
        for buf, state in zip(self.grads.buffers, self.states):
            self._publish(buf, state)
        return grad_norm, False

    def _owned_pieces(self) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[bool]]:
        """(grads, masters, exp_avgs, exp_avg_sqs, decays): this rank's chunk of every bucket, consecutive chunks
        joined up to `MAX_PIECE_ELEMENTS` (without the distributed optimizer a buffer is one piece or a few: a MoE's
        experts were ~250 buckets, four views each, sliced on the host while the GPU waited after the norm's read).
        Views are taken afresh: offloading may move the tensors."""
        pieces: tuple[list, list, list, list, list] = ([], [], [], [], [])
        for buf, state in zip(self.grads.buffers, self.states):
            rank, count = self.grads.owner(buf)
            spans: list[list[int]] = []  # [lo, hi, pos] in buf.data and in the state tensors
            for bucket in range(len(buf.buckets)):
                lo, hi = buf.chunk(bucket, rank, count)
                if hi == lo:  # nothing of this bucket is this rank's
                    continue
                pos = buf.buckets[bucket][0] // count
                if (spans and spans[-1][1] == lo and spans[-1][2] + spans[-1][1] - spans[-1][0] == pos
                        and hi - spans[-1][0] <= MAX_PIECE_ELEMENTS):
                    spans[-1][1] = hi
                else:
                    spans.append([lo, hi, pos])
            for lo, hi, pos in spans:
                chunk = (buf.data[lo:hi], *(t[pos:pos + hi - lo] for t in
                                            (state.master, state.exp_avg, state.exp_avg_sq)), buf.decay)
                for items, piece in zip(pieces, chunk):
                    items.append(piece)
        return pieces

    def _update(self, grads: list[Tensor], masters: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                decays: list[bool], clip_scale: float) -> None:
        """torch's AdamW maths in its fused kernel (`torch._fused_adamw_`, what `torch.optim.AdamW(fused=True)`
        runs, on CPU and CUDA): one pass reading each gradient and the state and writing the state, where torch's
        multi-tensor ops took eight (`bench/adamw_step.py`). The clipping scale rides along as the kernel's gradient
        divisor."""
        if not masters:
            return
        device = masters[0].device
        step = torch.full((), float(self.num_steps), dtype=torch.float32, device=device)  # the bias corrections'
        divisor = None if clip_scale == 1.0 else torch.full((), 1.0 / clip_scale, dtype=torch.float32, device=device)
        for decayed in (True, False):
            picked = [i for i, decay in enumerate(decays) if decay == decayed]
            if not picked:
                continue
            torch._fused_adamw_(
                [masters[i] for i in picked], [grads[i] for i in picked], [exp_avgs[i] for i in picked],
                [exp_avg_sqs[i] for i in picked], [], [step] * len(picked), lr=self.lr, beta1=self.betas[0],
                beta2=self.betas[1], weight_decay=self.weight_decay if decayed else 0.0, eps=self.eps,
                amsgrad=False, maximize=False, grad_scale=divisor, found_inf=None)

    def _publish(self, buf: GradBuffer, state: _State) -> None:
        """Write the updated master values into the model's params (all-gathered over DP when sharded): one
        multi-tensor copy per bucket when sharded (the gathered bucket is then freed), else one for the buffer."""
        rank, count = self.grads.owner(buf)
        group = self.layout.group(buf.group_name) if count > 1 else None
        current, values = -1, state.master
        params: list[Tensor] = []
        sources: list[Tensor] = []
        for param, offset, bucket in zip(buf.params, buf.offsets, buf.param_bucket):  # params in bucket order
            start, end = buf.buckets[bucket]
            if group is not None and bucket != current:
                _copy_all(params, sources)
                current, pos = bucket, start // count
                owned = state.master[pos:pos + (end - start) // count].to(buf.dtype)  # [bucket numel / dp]
                values = torch.empty(end - start, dtype=buf.dtype, device=owned.device)  # [bucket numel]
                all_gather_single(values, owned, group=group)
            base = start if group is not None else 0  # `values` is this bucket, or the whole unsharded master
            params.append(param)
            sources.append(values[offset - base:offset - base + param.numel()].view_as(param))
        _copy_all(params, sources)

    def state_tensors(self) -> list[Tensor]:
        """Every optimizer-state tensor (what offloading the optimizer state moves)."""
        return [t for s in self.states for t in (s.master, s.exp_avg, s.exp_avg_sq)]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, keyed by HF name. Layout dependent: ``params[name]["range"]`` is the [lo, hi) of the
        flattened local shard this rank owns (all of it without the distributed optimizer; with it, the part inside
        this rank's DP chunk). Tensors are views of the live state: save them before the next step."""
        params: dict[str, dict[str, Any]] = {}
        for buf, state in zip(self.grads.buffers, self.states):
            for param, lo, hi, pos in self.grads.fragments(buf):
                name = get_spec(param).hf_name
                if name in params:
                    raise ValueError(f"two parameters on this rank share hf_name {name!r}; state is keyed by it")
                params[name] = {"range": (lo, hi), "master": state.master[pos:pos + hi - lo],
                                "exp_avg": state.exp_avg[pos:pos + hi - lo],
                                "exp_avg_sq": state.exp_avg_sq[pos:pos + hi - lo]}
        return {"num_steps": self.num_steps, "params": params}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict` saved by the same rank of the same layout (and distributed-optimizer setting); the
        model params are then set from the loaded master weights."""
        mine, saved = self.state_dict()["params"], state_dict["params"]
        for name in sorted(set(mine) | set(saved)):
            own, theirs = mine.get(name, {}).get("range"), saved.get(name, {}).get("range")
            if theirs is None or own != tuple(theirs):
                raise ValueError(f"optimizer state for {name!r} covers {theirs} but this rank owns {own}: "
                                 "saved with another layout or distributed setting")
            for key in ("master", "exp_avg", "exp_avg_sq"):
                mine[name][key].copy_(saved[name][key])
        self.num_steps = state_dict["num_steps"]
        for buf, state in zip(self.grads.buffers, self.states):
            self._publish(buf, state)


ScheduleStyle = Literal["constant", "cosine", "linear"]


class LRScheduler:
    """Sets ``optimizer.lr`` for each step: linear warmup from 0 to the optimizer's initial lr, then constant, cosine
    or linear decay to ``min_lr_ratio * lr`` at step `decay_steps` (default `total_steps`), held there afterwards.

    Step ``n`` counts the `step()` calls so far, and the first update runs at ``lr_at(0)`` (0 with warmup, as in verl
    and Megatron). ``warmup_steps`` < 0 or None: ``int(warmup_steps_ratio * decay_steps)`` steps. With
    ``progress = (n - warmup) / (decay_steps - warmup)`` clipped to [0, 1]:
    cosine ``min + (lr - min) * (1 + cos(2 pi num_cycles progress)) / 2`` (num_cycles 0.5: one half wave down);
    linear ``lr - (lr - min) * progress``.

    `decay_steps` is Megatron's ``lr_decay_steps`` as verl's Megatron optimizer passes it to
    ``OptimizerParamScheduler`` (verl/utils/megatron/optimizer.py): the step, counted from 0 with the warmup
    included, at which the decay reaches the minimum, so the decay itself lasts ``decay_steps - warmup`` steps and
    later steps run at the minimum (Megatron's cosine is the half wave, num_cycles 0.5). verl defaults it to
    ``total_training_steps`` (None here: `total_steps`) and takes the warmup ratio of it, as done here. The constant
    style ignores it: Megatron returns the peak before looking at it.
    """

    def __init__(self, optimizer: AdamW, *, total_steps: int, warmup_steps: int | None = -1,
                 warmup_steps_ratio: float = 0.0, style: ScheduleStyle = "constant", min_lr_ratio: float = 0.0,
                 num_cycles: float = 0.5, decay_steps: int | None = None) -> None:
        if style not in ("constant", "cosine", "linear"):
            raise ValueError(f"lr schedule style {style!r}: expected constant, cosine or linear")
        if decay_steps is not None and decay_steps < 1:
            raise ValueError(f"lr_decay_steps={decay_steps}: expected a positive step count, or None for "
                             f"total_training_steps")
        decay_end = total_steps if decay_steps is None else decay_steps
        if warmup_steps is None or warmup_steps < 0:
            if warmup_steps_ratio > 0 and decay_end <= 0:
                raise ValueError(f"warmup_steps_ratio={warmup_steps_ratio} needs total_steps > 0, got {total_steps}")
            warmup_steps = int(warmup_steps_ratio * max(decay_end, 0))
        if style != "constant" and decay_end <= warmup_steps:
            what = "total_steps" if decay_steps is None else "lr_decay_steps"
            raise ValueError(f"{style} lr decay needs {what} > warmup steps, got {what}={decay_end}, "
                             f"warmup_steps={warmup_steps}")
        self.optimizer, self.peak_lr = optimizer, optimizer.lr
        self.total_steps, self.warmup_steps, self.style = total_steps, warmup_steps, style
        self.decay_end = decay_end  # the step the decay reaches min_lr at
        self.min_lr, self.num_cycles = min_lr_ratio * optimizer.lr, num_cycles
        self.num_steps = 0
        optimizer.lr = self.lr_at(0)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        if self.style == "constant":
            return self.peak_lr
        progress = min((step - self.warmup_steps) / (self.decay_end - self.warmup_steps), 1.0)
        if self.style == "cosine":
            factor = 0.5 * (1.0 + math.cos(2.0 * math.pi * self.num_cycles * progress))
        else:
            factor = 1.0 - progress
        return self.min_lr + (self.peak_lr - self.min_lr) * factor

    def step(self) -> None:
        self.num_steps += 1
        self.optimizer.lr = self.lr_at(self.num_steps)

    def state_dict(self) -> dict[str, int]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.num_steps = state_dict["num_steps"]
        self.optimizer.lr = self.lr_at(self.num_steps)
