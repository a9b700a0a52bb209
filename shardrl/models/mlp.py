"""Feed-forward blocks: the dense SwiGLU MLP (tensor parallel) and the MoE block around `MoELayer`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardrl.models.config import ModelConfig
from shardrl.models.fast_paths import FastPaths, elementwise
from shardrl.parallel.activation import gated_silu, swiglu
from shardrl.parallel.expert import MoELayer, MoENames, RouterOptions
from shardrl.parallel.layout import Layout
from shardrl.parallel.tensor import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    gather_tokens,
    scatter_tokens,
)
from shardrl.parallel.tensor_overlap import column_parallel, row_parallel


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, hidden_size: int, ffn_size: int, layout: Layout, prefix: str, bias: bool,
                 sequence_parallel: bool, dtype: torch.dtype, fast: FastPaths = FastPaths()) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.fast = layout.tp_group, sequence_parallel, fast
        bitwise = fast.bitwise
        self.gate_proj = ColumnParallelLinear(hidden_size, ffn_size, layout, f"{prefix}.gate_proj", bias, dtype=dtype,
                                              bitwise=bitwise)
        self.up_proj = ColumnParallelLinear(hidden_size, ffn_size, layout, f"{prefix}.up_proj", bias, dtype=dtype,
                                            bitwise=bitwise)
        self.down_proj = RowParallelLinear(ffn_size, hidden_size, layout, f"{prefix}.down_proj", bias,
                                           sequence_parallel, dtype=dtype, bitwise=bitwise)

    @property
    def column_linears(self) -> tuple[ColumnParallelLinear, ...]:
        """The linears that read the block's input, in output order (an inference engine packs them: one GEMM)."""
        return self.gate_proj, self.up_proj

    def forward(self, x: Tensor, num_tokens: int, residual: Tensor | None = None) -> Tensor:
        """x [T, H] (or this rank's SP chunk) -> same shape, plus `residual` where given; `num_tokens` is T."""
        gate, up = column_parallel(x, self.column_linears, self.group, self.sequence_parallel, num_tokens,
                                   self.fast.tp_overlap.backward)  # [T, F/tp] each
        return row_parallel(gated_silu(gate, up, elementwise(swiglu, self.fast.compile)), self.down_proj,
                            self.fast.tp_overlap.chunks, residual)


class MoEBlock(nn.Module):
    """Routed experts (`MoELayer`) plus, for Qwen2-MoE, a shared expert scaled by sigmoid(gate(x)).

    `MoELayer` wants each token exactly once per TP group: without sequence parallelism the replicated tokens are
    split over TP before it and gathered after; with it they are already split. The shared expert is an ordinary
    tensor-parallel MLP over all tokens.
    """

    def __init__(self, config: ModelConfig, layout: Layout, layer_id: int, sequence_parallel: bool,
                 dtype: torch.dtype, router: RouterOptions, fast: FastPaths = FastPaths()) -> None:
        super().__init__()
        moe = config.moe
        prefix = f"model.layers.{layer_id}.{moe.block_name}"
        gate, up, down = (f"{prefix}.experts.{{expert}}.{proj}.weight" for proj in moe.expert_proj)
        self.group, self.sequence_parallel = layout.tp_group, sequence_parallel
        self.experts = MoELayer(config.hidden_size, moe.ffn_size, moe.num_experts, moe.top_k, layout,
                                MoENames(f"{prefix}.gate.weight", gate, up, down), moe.norm_topk_prob,
                                router, dtype, layer_id, fast.bitwise)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = MLP(config.hidden_size, moe.shared_expert_size, layout, f"{prefix}.shared_expert",
                                     False, sequence_parallel, dtype, fast)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, layout, f"{prefix}.shared_expert_gate",
                                                       sequence_parallel, dtype, fast.bitwise)

    def forward(self, x: Tensor, num_tokens: int, residual: Tensor | None = None) -> Tensor:
        """x [T, H] (or this rank's SP chunk) -> same shape, plus `residual` where given; `num_tokens` is T."""
        if self.sequence_parallel:
            out = self.experts(x, num_tokens)
        else:
            out = gather_tokens(self.experts(scatter_tokens(x, self.group), num_tokens), self.group, num_tokens)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, num_tokens)
        return out if residual is None else residual + out
