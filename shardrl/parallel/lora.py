"""LoRA adapters on the tensor-parallel linears: y = W x + s * B (A x), s = alpha / rank, the base weight frozen.

How each adapter is split so that every layout computes the 1-process result:
* Column-parallel linear (output features split over TP, `ColumnParallelLinear`): A [r, in] whole on every rank,
  B [out/n, r] split as W is. A rank's gradient of A covers its own output features only, so it is summed over TP
  (`sum_grad_over_tp`); B's replicas (KV heads fewer than TP) are summed as W's are.
* Row-parallel linear (input features split, `RowParallelLinear`): A [r, in/tp] split as W is, B [out, r] whole.
  Each rank adds s * B (A_r x_r) to its partial product before the TP reduction, which sums the shards' A_r x_r as
  it sums W_r x_r; B's gradient is summed over TP.
Pipeline stages hold their own layers' adapters; sequence parallelism changes nothing (column inputs are gathered,
row outputs reduce-scattered, adapters included).

Initial values do not depend on the layout: every adapter's full A is drawn from a generator seeded by the run seed
and the tensor's name (kaiming-uniform with a = sqrt(5), as PEFT's default; B = 0, so training starts at the base
model), and each rank keeps its slice. Parameters carry PEFT's tensor names (`...q_proj.lora_A.weight`) in their
shard specs, so checkpoints, gradient reduction, clipping and the distributed optimizer treat them like any other
parameter.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from shardrl.parallel.layout import Layout
from shardrl.parallel.spec import ShardSpec, get_spec, set_spec
from shardrl.parallel.tensor import ColumnParallelLinear, RowParallelLinear, linear

ALL_LINEAR = "all-linear"
# The linears of shardrl's model families (`models.attention`, `models.mlp`): what `target_modules` can name.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRASettings:
    """verl's `model.lora_rank`, `lora_alpha`, `target_modules` (module names such as `q_proj`, or `all-linear`: every
    attention and MLP projection) and `exclude_modules`; `seed` draws the initial A; `initial`: a PEFT adapter
    directory (`model.lora_adapter_path`) whose tensors the adapters start from instead."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...] = ALL_LINEAR
    exclude_modules: tuple[str, ...] = ()
    seed: int = 0
    initial: str | None = None

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets(self, module_name: str) -> bool:
        """Whether the linear named `module_name` (its last component, e.g. `q_proj`) gets an adapter."""
        if module_name in self.exclude_modules:
            return False
        return self.target_modules == ALL_LINEAR or module_name in self.target_modules


class LoRA(nn.Module):
    """The adapter of one linear: `forward(x)` is s * B (A x) for the linear's (local) input x."""

    def __init__(self, base: ShardSpec, settings: LoRASettings, layout: Layout, split_input: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        out_size, in_size = base.full_shape
        prefix, rank, tp = base.hf_name.removesuffix(".weight"), settings.rank, layout.tp_size
        if split_input:  # row-parallel: A split along its input as W is, B whole
            a_spec = ShardSpec(f"{prefix}.lora_A.weight", (rank, in_size), dim=1, num_shards=base.num_shards,
                               index=base.index, group=base.group)
            b_spec = ShardSpec(f"{prefix}.lora_B.weight", (out_size, rank), sum_grad_over_tp=tp > 1)
        else:  # column-parallel: A whole, B split along its output as W is
            a_spec = ShardSpec(f"{prefix}.lora_A.weight", (rank, in_size), sum_grad_over_tp=tp > 1)
            b_spec = ShardSpec(f"{prefix}.lora_B.weight", (out_size, rank), dim=0, num_shards=base.num_shards,
                               index=base.index, group=base.group)
        self.scale, self.enabled = settings.scale, True
        self.lora_A = _param(_slice(_initial_a(a_spec, settings.seed), a_spec), a_spec, layout, dtype)
        self.lora_B = _param(torch.zeros(b_spec.local_shape()), b_spec, layout, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return linear(linear(x, self.lora_A), self.lora_B) * self.scale


def _initial_a(spec: ShardSpec, seed: int) -> Tensor:
    """The full A [r, in]: uniform in +-1/sqrt(in) (kaiming-uniform, a = sqrt(5)), from the seed and the name only."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.hf_name.encode()))
    bound = 1.0 / math.sqrt(spec.full_shape[1])
    return torch.rand(spec.full_shape, generator=generator, dtype=torch.float64) * (2 * bound) - bound


def _slice(full: Tensor, spec: ShardSpec) -> Tensor:
    if spec.dim is None:
        return full
    start, stop = spec.slice_range()
    return full.narrow(spec.dim, start, stop - start)


def _param(value: Tensor, spec: ShardSpec, layout: Layout, dtype: torch.dtype) -> nn.Parameter:
    param = nn.Parameter(value.to(device=layout.device, dtype=dtype).contiguous())
    return set_spec(param, spec)


def attach_lora(model: nn.Module, settings: LoRASettings, layout: Layout) -> list[LoRA]:
    """Give every targeted linear of `model` an adapter (`linear.lora`) in the base weight's dtype and freeze every
    other parameter; returns the adapters. A target name no linear of the model has is refused (a typo would
    otherwise train nothing)."""
    adapters, names = [], set()
    for module in model.modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        spec = get_spec(module.weight)
        name = spec.hf_name.removesuffix(".weight").rsplit(".", 1)[-1]
        names.add(name)
        if settings.targets(name):
            module.lora = LoRA(spec, settings, layout, isinstance(module, RowParallelLinear), module.weight.dtype)
            adapters.append(module.lora)
    wanted = () if settings.target_modules == ALL_LINEAR else settings.target_modules
    if unknown := sorted(set(wanted) - names):
        raise ValueError(f"LoRA target_modules {unknown}: the model has no such linear (it has {sorted(names)})")
    if settings.initial is not None:
        _load_peft_tensors(adapters, settings.initial)
    trainable = {id(p) for adapter in adapters for p in adapter.parameters()}
    for param in model.parameters():
        param.requires_grad_(id(param) in trainable)
    return adapters


PEFT_PREFIX = "base_model.model."  # PEFT names a saved adapter's tensors from the model it wraps
PEFT_WEIGHTS = "adapter_model.safetensors"


@torch.no_grad()
def _load_peft_tensors(adapters: Sequence[LoRA], directory: str) -> None:
    """Fill each adapter's A and B with this rank's slice of the PEFT adapter's tensors."""
    from safetensors import safe_open

    with safe_open(str(Path(directory) / PEFT_WEIGHTS), "pt") as saved:
        names = set(saved.keys())
        for param in (p for adapter in adapters for p in (adapter.lora_A, adapter.lora_B)):
            spec = get_spec(param)
            key = PEFT_PREFIX + spec.hf_name
            if key not in names:
                raise ValueError(f"{directory}/{PEFT_WEIGHTS}: no tensor {key!r} for this model's adapter")
            full = saved.get_tensor(key)
            if tuple(full.shape) != spec.full_shape:
                raise ValueError(f"{directory}/{PEFT_WEIGHTS}: {key!r} has shape {tuple(full.shape)}, the adapter "
                                 f"{spec.full_shape}")
            param.copy_(_slice(full, spec))


def lora_parameters(model: nn.Module | Sequence[nn.Module]) -> Iterator[nn.Parameter]:
    """The adapters' parameters of a model (or its pipeline chunks), in module order."""
    for chunk in model if isinstance(model, Sequence) else [model]:
        for module in chunk.modules():
            if isinstance(module, LoRA):
                yield from module.parameters()


@contextlib.contextmanager
def adapters_disabled(models: Sequence[nn.Module]) -> Iterator[None]:
    """Run `models` as their base: every adapter adds nothing inside the block (the reference policy of a LoRA run,
    with no second copy of the weights)."""
    adapters = [m for model in models for m in model.modules() if isinstance(m, LoRA)]
    states = [a.enabled for a in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(adapters, states):
            adapter.enabled = state
