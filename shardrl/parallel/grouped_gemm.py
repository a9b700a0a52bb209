"""The SiLU-gated FFN of many experts over rows already grouped by expert: `down(silu(gate(x)) * up(x))`.

One function, two paths. The portable path runs one GEMM per expert on its contiguous slice of rows (a loop over
experts, never over tokens) and is the reference. On CUDA with bf16 it runs the same maths as three grouped GEMMs
(`torch.nn.functional.grouped_mm`), which need no host sync for the per-expert row counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from shardrl.parallel.activation import gated_silu
from shardrl.parallel.data import add_into_main_grad, fills_main_grad


@dataclass(frozen=True)
class ExpertAdapters:
    """LoRA factors of the experts (`parallel.lora.ExpertLoRA`), per expert e: gate_e += s * B_gate[e] A[e] x (and up
    with B_up and the same A), down_e += s * B_down[e] A_down[e] h. A side is None where it has no adapter."""

    scale: float
    gate_up_a: Tensor | None  # [E, r, H]
    gate_up_b: tuple[Tensor, ...]  # (B_gate, B_up) [E, F, r] each, or ()
    down_a: Tensor | None  # [E, r, F]
    down_b: Tensor | None  # [E, H, r]

    @property
    def rank(self) -> int:
        return (self.gate_up_a if self.gate_up_a is not None else self.down_a).shape[1]


def expert_ffn(x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
               grouped: bool | None = None, bitwise: bool = False, adapters: ExpertAdapters | None = None) -> Tensor:
    """Apply expert `e`'s FFN to its block of rows.

    x [N, H] holds the rows of expert 0, then expert 1, ...; counts [E] (int) gives each expert's number of rows.
    w_gate, w_up [E, F, H]; w_down [E, H, F] (F may be this rank's ETP slice: the result is then a partial sum).
    `grouped` picks the path; None picks the grouped GEMM where it is supported. `bitwise` (CUDA): the
    batch-invariant grouped GEMM forward (`_BitwiseGroupedPair` for gate and up, `_BitwiseGrouped` for down). `adapters`: LoRA on the experts. Returns [N, H].
    """
    if bitwise and adapters is not None:
        raise ValueError("expert_ffn: bitwise mode has no batch-invariant LoRA GEMMs")
    if bitwise and x.is_cuda:
        from shardrl.parallel.bitwise_kernels import expert_tiles  # Triton: CUDA installs only

        tiles = expert_tiles(counts, x.shape[0])  # one tile map for the three GEMMs
        gate, up = _BitwiseGroupedPair.apply(x, w_gate, w_up, tiles)
        return _BitwiseGrouped.apply(gated_silu(gate, up), w_down, tiles)
    if grouped is None:
        grouped = can_use_grouped_mm(x, w_gate, w_down, adapters)
    if grouped:
        return _grouped_ffn(x, counts, w_gate, w_up, w_down, adapters)
    return _looped_ffn(x, counts, w_gate, w_up, w_down, adapters)


def can_use_grouped_mm(x: Tensor, w_in: Tensor, w_out: Tensor, adapters: ExpertAdapters | None = None) -> bool:
    """The grouped kernel wants CUDA bf16 and 16-byte aligned rows (H, F and a LoRA rank multiples of 8 elements)."""
    return (
        hasattr(F, "grouped_mm")
        and x.is_cuda
        and x.dtype == w_in.dtype == w_out.dtype == torch.bfloat16
        and w_in.shape[-1] % 8 == 0
        and w_out.shape[-1] % 8 == 0
        and (adapters is None or adapters.rank % 8 == 0)
    )


def _looped_ffn(x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                adapters: ExpertAdapters | None) -> Tensor:
    outputs = []
    for e, rows in enumerate(x.split(counts.tolist())):  # rows [N_e, H]
        gate, up = F.linear(rows, w_gate[e]), F.linear(rows, w_up[e])  # [N_e, F]
        if adapters is not None and adapters.gate_up_a is not None:
            shared = F.linear(rows, adapters.gate_up_a[e])  # [N_e, r]
            b_gate, b_up = adapters.gate_up_b
            gate = gate + F.linear(shared, b_gate[e]) * adapters.scale
            up = up + F.linear(shared, b_up[e]) * adapters.scale
        hidden = F.silu(gate) * up
        out = F.linear(hidden, w_down[e])  # [N_e, H]
        if adapters is not None and adapters.down_a is not None:
            out = out + F.linear(F.linear(hidden, adapters.down_a[e]), adapters.down_b[e]) * adapters.scale
        outputs.append(out)
    return torch.cat(outputs)


def _grouped_ffn(x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                 adapters: ExpertAdapters | None) -> Tensor:
    offsets = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert's group

    def grouped(rows: Tensor, weights: Tensor) -> Tensor:  # each expert's rows @ weights[e]^T
        # grouped_mm computes x_e @ b[e] with b [E, K, N]; the transposed view is the column-major operand it prefers.
        return F.grouped_mm(rows, weights.transpose(1, 2), offs=offsets)

    gate, up = _expert_linear(x, w_gate, offsets), _expert_linear(x, w_up, offsets)  # [N, F]
    if adapters is not None and adapters.gate_up_a is not None:
        shared = grouped(x, adapters.gate_up_a)  # [N, r]
        b_gate, b_up = adapters.gate_up_b
        gate = gate + grouped(shared, b_gate) * adapters.scale
        up = up + grouped(shared, b_up) * adapters.scale
    hidden = gated_silu(gate, up)
    down = _expert_linear(hidden, w_down, offsets)  # [N, H]
    if adapters is not None and adapters.down_a is not None:
        down = down + grouped(grouped(hidden, adapters.down_a), adapters.down_b) * adapters.scale
    return _ContiguousGrad.apply(down)


def _expert_linear(x: Tensor, weights: Tensor, offsets: Tensor) -> Tensor:
    """Each expert's rows @ weights[e]^T. Under autograd, for weights with a `GradBuffers` main_grad, through
    `_ExpertLinear` (the weight gradient goes into main_grad at once); otherwise (inference, the rollout's compiled
    decode included) torch's grouped GEMM with its own autograd."""
    if fills_main_grad(weights):
        return _ExpertLinear.apply(x, weights, offsets)
    return F.grouped_mm(x, weights.transpose(1, 2), offs=offsets)


class _ExpertLinear(torch.autograd.Function):
    """y = x_e @ w[e]^T over each expert's rows (offsets [E]: each expert's end row), forward and backward the same
    grouped GEMMs as `grouped_mm`'s own autograd; the weight gradient goes into the weights' fp32 main_grad at once
    (`add_into_main_grad`) rather than through autograd's accumulation and the gradient hook."""

    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, offsets: Tensor) -> Tensor:
        ctx.save_for_backward(x, weights, offsets)
        return F.grouped_mm(x, weights.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weights, offsets = ctx.saved_tensors
        wants_x, wants_weights, _ = ctx.needs_input_grad
        grad_x, grad_weights = _grouped_backward(grad.contiguous(), x, weights, offsets, wants_x, wants_weights)
        return grad_x, grad_weights, None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: grouped_mm's backward rejects broadcast gradients
    (stride 0, as `out.sum().backward()` produces) with "Invalid strides/sizes" (seen on torch 2.11)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


class _BitwiseGrouped(_ExpertLinear):
    """y = x_e @ w[e]^T per expert's rows. Forward: the batch-invariant grouped GEMM (`bitwise_kernels`) over a tile
    map of the rows, whose row bits do not depend on how many rows any expert got. Backward: `_ExpertLinear`'s
    (torch's grouped GEMMs at the map's expert ends: no host read)."""

    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, tiles) -> Tensor:
        from shardrl.parallel.bitwise_kernels import grouped_matmul  # Triton: CUDA installs only

        ctx.save_for_backward(x, weights, tiles.expert_end)
        return grouped_matmul(x, weights, tiles)


class _BitwiseGroupedPair(torch.autograd.Function):
    """`_BitwiseGrouped` of the same rows through two weight sets (gate and up) in one launch and one autograd node
    (the small models' steps are host-bound: each launch and node counts)."""

    @staticmethod
    def forward(ctx, x: Tensor, w_first: Tensor, w_second: Tensor, tiles) -> tuple[Tensor, Tensor]:
        from shardrl.parallel.bitwise_kernels import grouped_matmul_pair  # Triton: CUDA installs only

        ctx.save_for_backward(x, w_first, w_second, tiles.expert_end)
        return grouped_matmul_pair(x, w_first, w_second, tiles)

    @staticmethod
    def backward(ctx, grad_first: Tensor, grad_second: Tensor):
        x, w_first, w_second, offsets = ctx.saved_tensors
        wants_x, wants_first, wants_second, _ = ctx.needs_input_grad
        grad_x, grad_w_first = _grouped_backward(grad_first.contiguous(), x, w_first, offsets, wants_x, wants_first)
        more_x, grad_w_second = _grouped_backward(grad_second.contiguous(), x, w_second, offsets, wants_x,
                                                  wants_second)
        return grad_x + more_x if wants_x else None, grad_w_first, grad_w_second, None


def _grouped_backward(grad: Tensor, x: Tensor, weights: Tensor, offsets: Tensor, wants_x: bool,
                      wants_weights: bool) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of y = x_e @ w[e]^T per expert's rows (offsets [E]: each expert's end row) from grad [N, out]:
    x's [N, in] and the weights' [E, out, in] (expert e's grad^T @ x over its rows; None where it went into the
    weights' main_grad, `add_into_main_grad`)."""
    grad_x = F.grouped_mm(grad, weights, offs=offsets) if wants_x else None
    grad_weights = add_into_main_grad(weights, F.grouped_mm(grad.t(), x, offs=offsets)) if wants_weights else None
    return grad_x, grad_weights
