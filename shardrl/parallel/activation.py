"""The SwiGLU activation of dense and expert FFNs, silu(gate) * up, and its one device switch.

On CUDA it runs as one Triton kernel each way (`swiglu_kernel.py`): written in torch ops it is a silu, a product,
and in backward a silu backward and two more products, each a pass over [tokens, ffn] activations (~3% of a 1.2B
model's training step on one H200, more for MoE's top-k expert rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """The reference: silu(gate) * up in the tensors' dtype."""
    return F.silu(gate) * up


def gated_silu(gate: Tensor, up: Tensor, portable: Callable[[Tensor, Tensor], Tensor] = swiglu) -> Tensor:
    """gate, up [N, F] -> silu(gate) * up: the fused kernel (fp32 maths) on CUDA, else `portable` (`swiglu`, or its
    compiled version)."""
    if gate.is_cuda:
        from shardrl.parallel.swiglu_kernel import fused_swiglu  # Triton: CUDA installs only

        return fused_swiglu(gate, up)
    return portable(gate, up)
