"""LoRA adapters on the tensor-parallel linears: y = W x + s * B (A x), s = alpha / rank, the base weight frozen.

How each adapter is split so that every layout computes the 1-process result:
* Column-parallel linear (output features split over TP, `ColumnParallelLinear`): A [r, in] whole on every rank,
  B [out/n, r] split as W is. A rank's gradient of A covers its own output features only, so it is summed over TP
  (`sum_grad_over_group`); B's replicas (KV heads fewer than TP) are summed as W's are.
* Row-parallel linear (input features split, `RowParallelLinear`): A [r, in/tp] split as W is, B [out, r] whole.
  Each rank adds s * B (A_r x_r) to its partial product before the TP reduction, which sums the shards' A_r x_r as
  it sums W_r x_r; B's gradient is summed over TP.
Pipeline stages hold their own layers' adapters; sequence parallelism changes nothing (column inputs are gathered,
row outputs reduce-scattered, adapters included).

MoE experts (`ExpertLoRA`, PEFT's `target_parameters` on transformers' stacked `mlp.experts.gate_up_proj` and
`mlp.experts.down_proj`): one adapter per expert, held by the expert's EP rank and split over ETP as the expert
weights are. gate and up share one A, as PEFT's single adapter on the stacked [gate; up] weight does: A [r, H] whole,
B_gate and B_up [F/ETP, r] split; down: A [r, F/ETP] split, B [H, r] whole. Each ETP rank's gradient of a whole
factor covers its F slice only, so it is summed over ETP.

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

from shardrl.parallel.expert import MoELayer
from shardrl.parallel.layout import Layout
from shardrl.parallel.spec import ShardSpec, get_spec, set_spec
from shardrl.parallel.tensor import ColumnParallelLinear, RowParallelLinear, linear

ALL_LINEAR = "all-linear"
# The linears of shardrl's model families (`models.attention`, `models.mlp`): what `target_modules` can name.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# transformers' stacked weights of an MoE block's routed experts, as PEFT's `target_parameters` names them.
EXPERT_GATE_UP, EXPERT_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
EXPERT_PARAMETERS = (EXPERT_GATE_UP, EXPERT_DOWN)


@dataclass(frozen=True)
class LoRASettings:
    """verl's `model.lora_rank`, `lora_alpha`, `target_modules` (module names such as `q_proj`, or `all-linear`: every
    attention and MLP projection) and `exclude_modules`; `seed` draws the initial A; `initial`: a PEFT adapter
    directory (`model.lora_adapter_path`) whose tensors the adapters start from instead. `target_parameters`:
    PEFT's key for the routed experts' stacked weights (`EXPERT_PARAMETERS`), which no `target_modules` name
    reaches (as in PEFT, where `all-linear` covers `nn.Linear` modules only); its order is PEFT's wrapping order."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...] = ALL_LINEAR
    exclude_modules: tuple[str, ...] = ()
    seed: int = 0
    initial: str | None = None
    target_parameters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if unknown := sorted(set(self.target_parameters) - set(EXPERT_PARAMETERS)):
            raise ValueError(f"LoRA target_parameters {unknown}: shardrl adapts {', '.join(EXPERT_PARAMETERS)}")

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
            b_spec = ShardSpec(f"{prefix}.lora_B.weight", (out_size, rank), sum_grad_over_group=tp > 1)
        else:  # column-parallel: A whole, B split along its output as W is
            a_spec = ShardSpec(f"{prefix}.lora_A.weight", (rank, in_size), sum_grad_over_group=tp > 1)
            b_spec = ShardSpec(f"{prefix}.lora_B.weight", (out_size, rank), dim=0, num_shards=base.num_shards,
                               index=base.index, group=base.group)
        self.scale, self.enabled = settings.scale, True
        self.lora_A = _param(_initial_a(a_spec, settings.seed), a_spec, layout, dtype)
        self.lora_B = _param(torch.zeros(b_spec.local_shape()), b_spec, layout, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return linear(linear(x, self.lora_A), self.lora_B) * self.scale


class ExpertLoRA(nn.Module):
    """The adapters of one MoE layer's routed experts on one stacked weight (`EXPERT_GATE_UP` or `EXPERT_DOWN`): a
    `lora_A` [E_local, r, in] and one `lora_B` [E_local, out, r] per expert weight it adapts (gate and up share A),
    split over ETP as those weights are (see the module docstring). Specs name the tensors per expert
    (`...experts.{expert}.gate_up_proj.lora_A.weight`, `...experts.{expert}.gate_proj.lora_B.weight`)."""

    def __init__(self, parameter: str, bases: Sequence[ShardSpec], layer_id: int, num_experts: int,
                 settings: LoRASettings, layout: Layout, dtype: torch.dtype) -> None:
        """`bases`: the specs of the expert weights it adapts (w_gate and w_up, or w_down); `layer_id` and
        `num_experts` (over all EP ranks) place it in a PEFT adapter."""
        super().__init__()
        self.parameter, self.layer_id, self.num_experts = parameter, layer_id, num_experts
        self.scale, self.enabled = settings.scale, True
        rank, first = settings.rank, bases[0]
        out_size, in_size = first.full_shape
        whole = dict(group=first.group, expert_ids=first.expert_ids, sum_grad_over_group=layout.etp_size > 1)
        split = dict(num_shards=first.num_shards, index=first.index, group=first.group, expert_ids=first.expert_ids)
        if parameter == EXPERT_DOWN:  # the input (F) is split over ETP: A split as w_down, B whole
            (base,) = bases
            stem = base.hf_name.removesuffix(".weight")
            a_spec = ShardSpec(f"{stem}.lora_A.weight", (rank, in_size), dim=1, **split)
            b_specs = [ShardSpec(f"{stem}.lora_B.weight", (out_size, rank), **whole)]
        else:  # gate and up: the output (F) is split, A whole and shared
            experts = first.hf_name.rsplit(".", 2)[0]  # "...experts.{expert}"
            a_spec = ShardSpec(f"{experts}.gate_up_proj.lora_A.weight", (rank, in_size), **whole)
            b_specs = [ShardSpec(f"{base.hf_name.removesuffix('.weight')}.lora_B.weight", (out_size, rank), dim=0,
                                 **split) for base in bases]
        self.lora_A = _param(_initial_a(a_spec, settings.seed), a_spec, layout, dtype)
        self.lora_B = nn.ParameterList([_param(torch.zeros(s.local_shape()), s, layout, dtype) for s in b_specs])


def _initial_a(spec: ShardSpec, seed: int) -> Tensor:
    """This rank's slice of A (of each local expert): the full A [r, in] is uniform in +-1/sqrt(in) (kaiming-uniform,
    a = sqrt(5)), drawn from the seed and the tensor's name only."""
    def full(name: str) -> Tensor:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(spec.full_shape[1])
        return torch.rand(spec.full_shape, generator=generator, dtype=torch.float64) * (2 * bound) - bound

    if not spec.expert:
        return _slice(full(spec.hf_name), spec)
    return torch.stack([_slice(full(name), spec) for name in spec.hf_names()])


def _slice(full: Tensor, spec: ShardSpec) -> Tensor:
    """This rank's piece of one full tensor (of one expert's, for experts) along the spec's dim."""
    if spec.dim is None:
        return full
    start, stop = spec.slice_range()
    return full.narrow(spec.dim, start, stop - start)


def _param(value: Tensor, spec: ShardSpec, layout: Layout, dtype: torch.dtype) -> nn.Parameter:
    param = nn.Parameter(value.to(device=layout.device, dtype=dtype).contiguous())
    return set_spec(param, spec)


def attach_lora(model: nn.Module, settings: LoRASettings, layout: Layout) -> list[LoRA | ExpertLoRA]:
    """Give every targeted linear of `model` an adapter (`linear.lora`) and every MoE layer those of its targeted
    expert weights (`MoELayer.lora_gate_up`, `lora_down`), in the base weights' dtype, and freeze every other
    parameter; returns the adapters. A target name no linear of the model has is refused (a typo would otherwise
    train nothing; expert targets on a model without experts are refused by the planner, `job.model_check`)."""
    adapters: list[LoRA | ExpertLoRA] = []
    names = set()
    for module in model.modules():
        if isinstance(module, MoELayer):
            adapters.extend(_attach_expert_lora(module, settings, layout))
            continue
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
        _load_peft_tensors(adapters, settings.initial, settings.target_parameters)
    trainable = {id(p) for adapter in adapters for p in adapter.parameters()}
    for param in model.parameters():
        param.requires_grad_(id(param) in trainable)
    return adapters


def _attach_expert_lora(layer: MoELayer, settings: LoRASettings, layout: Layout) -> list[ExpertLoRA]:
    specs = {name: get_spec(getattr(layer, name)) for name in ("w_gate", "w_up", "w_down")}
    dtype = layer.w_gate.dtype
    if EXPERT_GATE_UP in settings.target_parameters:
        layer.lora_gate_up = ExpertLoRA(EXPERT_GATE_UP, (specs["w_gate"], specs["w_up"]), layer.layer_id,
                                        layer.num_experts, settings, layout, dtype)
    if EXPERT_DOWN in settings.target_parameters:
        layer.lora_down = ExpertLoRA(EXPERT_DOWN, (specs["w_down"],), layer.layer_id, layer.num_experts, settings,
                                     layout, dtype)
    return [m for m in (layer.lora_gate_up, layer.lora_down) if m is not None]


def adapted_weights(chunks: Sequence[nn.Module]) -> dict[int, tuple[nn.Parameter, nn.Parameter, float]]:
    """id(base weight) -> (its adapter's A, B, scale) over every adapter of the chunks (expert weights included:
    w_gate and w_up share their A): what merging W + s * B A needs."""
    out = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(getattr(module, "lora", None), LoRA):
                out[id(module.weight)] = module.lora.lora_A, module.lora.lora_B, module.lora.scale
            elif isinstance(module, MoELayer):
                if module.lora_gate_up is not None:
                    a, (b_gate, b_up) = module.lora_gate_up.lora_A, module.lora_gate_up.lora_B
                    out[id(module.w_gate)] = a, b_gate, module.lora_gate_up.scale
                    out[id(module.w_up)] = a, b_up, module.lora_gate_up.scale
                if module.lora_down is not None:
                    out[id(module.w_down)] = module.lora_down.lora_A, module.lora_down.lora_B[0], module.lora_down.scale
    return out


PEFT_PREFIX = "base_model.model."  # PEFT names a saved adapter's tensors from the model it wraps
PEFT_WEIGHTS = "adapter_model.safetensors"


def peft_expert_keys(layer_id: int, parameter: str, targeted: Sequence[str]) -> tuple[str, str]:
    """PEFT's names of the A and B of `parameter`'s expert adapter in layer `layer_id`. PEFT wraps the experts module
    once per targeted parameter in `target_parameters` order, the first innermost: its tensors sit under one
    `base_layer.` per later wrapper."""
    depth = len(targeted) - 1 - list(targeted).index(parameter)
    stem = f"{PEFT_PREFIX}model.layers.{layer_id}.mlp.experts." + "base_layer." * depth
    return stem + "lora_A.weight", stem + "lora_B.weight"


def stack_expert_adapter(a: Tensor, bs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Every expert's full A [E, r, in] and B(s) [E, out, r] -> PEFT's stacked A [E*r, in] (expert-major) and B
    [out, r*E] (rank-major: column j*E + e is expert e's column j); gate's and up's Bs stack as [gate; up]."""
    b = torch.cat(list(bs), dim=1)  # [E, out, r]
    return a.reshape(-1, a.shape[-1]), b.permute(1, 2, 0).reshape(b.shape[1], -1)


def unstack_expert_adapter(a: Tensor, b: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """The inverse of `stack_expert_adapter`: A [E, r, in] and B [E, out, r] (gate's rows, then up's)."""
    return a.reshape(num_experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, num_experts).permute(2, 0, 1)


@torch.no_grad()
def _load_peft_tensors(adapters: Sequence[LoRA | ExpertLoRA], directory: str,
                       targeted: Sequence[str]) -> None:
    """Fill each adapter's A and B with this rank's slice of the PEFT adapter's tensors."""
    from safetensors import safe_open

    with safe_open(str(Path(directory) / PEFT_WEIGHTS), "pt") as saved:
        names = set(saved.keys())

        def read(key: str, shape: tuple[int, ...]) -> Tensor:
            if key not in names:
                raise ValueError(f"{directory}/{PEFT_WEIGHTS}: no tensor {key!r} for this model's adapter")
            full = saved.get_tensor(key)
            if tuple(full.shape) != shape:
                raise ValueError(f"{directory}/{PEFT_WEIGHTS}: {key!r} has shape {tuple(full.shape)}, the adapter "
                                 f"{shape}")
            return full

        for adapter in adapters:
            if isinstance(adapter, LoRA):
                for param in (adapter.lora_A, adapter.lora_B):
                    spec = get_spec(param)
                    param.copy_(_slice(read(PEFT_PREFIX + spec.hf_name, spec.full_shape), spec))
                continue
            a_key, b_key = peft_expert_keys(adapter.layer_id, adapter.parameter, targeted)
            a_spec, b_specs = get_spec(adapter.lora_A), [get_spec(b) for b in adapter.lora_B]
            experts, (rank, in_size) = adapter.num_experts, a_spec.full_shape
            rows = [spec.full_shape[0] for spec in b_specs]
            a, b = unstack_expert_adapter(read(a_key, (experts * rank, in_size)),
                                          read(b_key, (sum(rows), rank * experts)), experts)
            ids = list(a_spec.expert_ids)
            adapter.lora_A.copy_(torch.stack([_slice(a[e], a_spec) for e in ids]))
            for param, spec, piece in zip(adapter.lora_B, b_specs, b.split(rows, dim=1)):
                param.copy_(torch.stack([_slice(piece[e], spec) for e in ids]))


def lora_parameters(model: nn.Module | Sequence[nn.Module]) -> Iterator[nn.Parameter]:
    """The adapters' parameters of a model (or its pipeline chunks), in module order."""
    for chunk in model if isinstance(model, Sequence) else [model]:
        for module in chunk.modules():
            if isinstance(module, (LoRA, ExpertLoRA)):
                yield from module.parameters()


def adapter_modules(models: Sequence[nn.Module]) -> list[LoRA | ExpertLoRA]:
    """Every adapter of `models`, in module order (`enabled` switches each one's term in the forward)."""
    return [m for model in models for m in model.modules() if isinstance(m, (LoRA, ExpertLoRA))]


@contextlib.contextmanager
def adapters_disabled(models: Sequence[nn.Module]) -> Iterator[None]:
    """Run `models` as their base: every adapter adds nothing inside the block (the reference policy of a LoRA run,
    with no second copy of the weights)."""
    adapters = adapter_modules(models)
    states = [a.enabled for a in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(adapters, states):
            adapter.enabled = state
