"""Model options that change speed, not maths (beyond float rounding), and the one switch to compiled kernels.

The elementwise chains (RMSNorm, rotary, SwiGLU) are plain torch functions: eager they are the reference the tests
compare against; with `compile` each runs as the kernels `torch.compile` fuses it into (on GPU through Triton, on
CPU through a C++ compiler), so a chain of casts, reductions and multiplies costs one pass over memory. On CUDA the
rotary and SwiGLU chains always run as hand-written fused kernels (`rope_kernel.py`, `parallel/swiglu_kernel.py`),
so there `compile` changes RMSNorm only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch

from shardrl.parallel.tensor_overlap import TPOverlap

Fn = TypeVar("Fn", bound=Callable)
# Training attention on CUDA: torch's flash kernels, FlashAttention-4 (the optional `flash-attn-4` package), or FA4
# where it is installed and the GPU is one it runs on, else torch's.
AttentionKernel = Literal["flash", "fa4", "auto"]


@dataclass(frozen=True)
class FastPaths:
    """tp_overlap: how tensor-parallel collectives overlap compute; compile: `torch.compile` the elementwise
    chains (verl's `use_torch_compile`); bitwise: batch-invariant kernels on CUDA (`parallel/bitwise_kernels.py`)
    for every GEMM, norm and attention, so a token's bits do not depend on the rest of its batch and the rollout
    engine and the trainer compute the same log-probs (`rollout.bitwise_logprobs`). The one option here that
    changes bits on purpose; it costs speed. attention: which fused kernel runs packed causal attention on CUDA
    (`AttentionKernel`; FA4 ran 1.6-2.0x torch's flash forward + backward on an H200, `bench/attention_kernels.py`);
    bitwise mode runs its own. fused_logprobs: log-probs and entropies from the hidden states and the LM head one
    token chunk at a time, never holding the whole batch's logits (verl's `use_fused_kernels`;
    `parallel/fused_logprobs.py`): less memory, one more LM head GEMM in the backward."""

    tp_overlap: TPOverlap = field(default_factory=TPOverlap)
    compile: bool = False
    bitwise: bool = False
    attention: AttentionKernel = "flash"
    fused_logprobs: bool = False


@functools.cache
def _compiled(fn: Fn) -> Fn:
    # dynamic: token counts change with every packed micro batch, so one symbolic-shape graph serves them all.
    return torch.compile(fn, dynamic=True)


def elementwise(fn: Fn, compile: bool) -> Fn:
    """`fn` itself, or its compiled version (built on first use, once per process)."""
    return _compiled(fn) if compile else fn
