"""Tensor parallelism (TP) and sequence parallelism (SP): the collectives and the sharded linear layers (the
vocab-sharded embedding and logprob maths are in vocab.py).

Conventions (the same on gloo and NCCL):

* Activations outside a TP region are *replicated* over the TP group (`[T, H]` on every rank) or, with sequence
  parallelism, *split by tokens* (`[T/tp, H]`: rank r holds the r-th chunk of `token_split_sizes(T, tp)`).
* A TP region starts with `enter_tp` (identity whose backward all-reduces, or an all-gather of the token chunks)
  and ends in a `RowParallelLinear` (all-reduce, or reduce-scatter back into token chunks).
* Column-parallel weights are split along their output rows, row-parallel weights along their input columns; each
  parameter maps to exactly one HF tensor, so q/k/v and gate/up stay separate parameters (no fused QKV / gate-up):
  loading, export and weight sync then need no re-interleaving. For inference an engine may still pack such a
  group's storage back to back (`pack_adjacent`), and `apply_columns` then runs it as one GEMM.
* With a group of size 1 (`group is None`) every collective is skipped.
* Token chunks may be uneven (T need not divide by tp): collectives pad each chunk to the largest one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from shardrl.parallel.collectives import all_gather_single, reduce_scatter_single
from shardrl.parallel.data import accumulate_weight_grad
from shardrl.parallel.layout import Layout
from shardrl.parallel.spec import ShardSpec, set_spec

Group = dist.ProcessGroup | None
Work = dist.Work


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def token_split_sizes(num_tokens: int, size: int) -> list[int]:
    """Tokens held by each rank when `num_tokens` are split over `size` ranks (the first ranks take one extra)."""
    base, extra = divmod(num_tokens, size)
    return [base + (r < extra) for r in range(size)]


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0])).contiguous()


def all_gather_tokens(x: Tensor, group: dist.ProcessGroup, num_tokens: int) -> Tensor:
    """x [T_r, ...], this rank's chunk -> [T, ...], all chunks in rank order."""
    sizes = token_split_sizes(num_tokens, group_size(group))
    pad = sizes[0]
    out = x.new_empty(pad * len(sizes), *x.shape[1:])
    all_gather_single(out, _pad_rows(x, pad), group=group)
    return torch.cat([chunk[:n] for chunk, n in zip(out.split(pad), sizes)])


def reduce_scatter_tokens(x: Tensor, group: dist.ProcessGroup, async_op: bool = False) -> tuple[Tensor, Work | None]:
    """x [T, ...] partial sums -> this rank's token chunk of the sum over the group, and the pending work with
    `async_op` (the chunk is valid only after `work.wait()`)."""
    sizes = token_split_sizes(x.shape[0], group_size(group))
    pad = sizes[0]
    chunks = [_pad_rows(c, pad) for c in x.split(sizes)]
    out = x.new_empty(pad, *x.shape[1:])
    work = reduce_scatter_single(out, torch.cat(chunks), group=group, async_op=async_op)
    return out[: sizes[group_rank(group)]], work


def _own_tokens(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """x [T, ...] replicated -> this rank's token chunk (a copy, so later in-place ops cannot alias)."""
    return x.split(token_split_sizes(x.shape[0], group_size(group)))[group_rank(group)].contiguous()


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """Token chunks -> all tokens; the gradients of the TP region behind it are partial sums, so backward sums."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, num_tokens: int) -> Tensor:
        ctx.group = group
        return all_gather_tokens(x, group, num_tokens)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_tokens(grad.contiguous(), ctx.group)[0], None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group, ctx.num_tokens = group, x.shape[0]
        return reduce_scatter_tokens(x, group)[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_gather_tokens(grad.contiguous(), ctx.group, ctx.num_tokens), None


class _ScatterTokens(torch.autograd.Function):
    """Replicated tokens -> this rank's chunk; downstream gradients are per-chunk and complete, so backward gathers."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group, ctx.num_tokens = group, x.shape[0]
        return _own_tokens(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_gather_tokens(grad.contiguous(), ctx.group, ctx.num_tokens), None


class _GatherTokens(torch.autograd.Function):
    """Chunks -> replicated tokens; every rank then sees the full (identical) gradient, so backward keeps its chunk."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, num_tokens: int) -> Tensor:
        ctx.group = group
        return all_gather_tokens(x, group, num_tokens)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own_tokens(grad, ctx.group), None, None


def enter_tp(x: Tensor, group: Group, sequence_parallel: bool, num_tokens: int) -> Tensor:
    """Start a TP region: replicated x [T, H] passes through (backward all-reduces); SP chunks are all-gathered."""
    if group is None:
        return x
    return _GatherFromSP.apply(x, group, num_tokens) if sequence_parallel else _CopyToTP.apply(x, group)


def exit_tp(x: Tensor, group: Group, sequence_parallel: bool) -> Tensor:
    """End a TP region: partial sums x [T, H] are all-reduced, or reduce-scattered into SP token chunks."""
    if group is None:
        return x
    return _ReduceScatterToSP.apply(x, group) if sequence_parallel else _ReduceFromTP.apply(x, group)


def scatter_tokens(x: Tensor, group: Group) -> Tensor:
    """Replicated x [T, ...] -> this rank's chunk [T_r, ...] (e.g. to feed each token to the MoE layer once)."""
    return x if group is None else _ScatterTokens.apply(x, group)


def gather_tokens(x: Tensor, group: Group, num_tokens: int) -> Tensor:
    """This rank's chunk [T_r, ...] -> replicated [T, ...]; the inverse of `scatter_tokens`."""
    return x if group is None else _GatherTokens.apply(x, group, num_tokens)


def shard_index(layout: Layout, num_shards: int) -> int:
    """Which of `num_shards` TP shards this rank holds; consecutive ranks share a shard when num_shards < tp."""
    tp = layout.tp_size
    if tp % num_shards and num_shards % tp:
        raise ValueError(f"{num_shards} shards cannot be spread over tensor parallel size {tp}")
    return layout.tp_rank // max(tp // num_shards, 1)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, bitwise: bool,
                residual: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        return _linear_forward(x, weight, bias, bitwise, residual)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        wants_x, wants_weight, wants_bias, _, wants_residual = ctx.needs_input_grad
        grad_rows = grad.reshape(-1, grad.shape[-1])  # [N, out]
        grad_x = grad.matmul(weight) if wants_x else None
        grad_weight = accumulate_weight_grad(weight, grad_rows, x.reshape(-1, x.shape[-1])) if wants_weight else None
        return grad_x, grad_weight, grad_rows.sum(0) if wants_bias else None, None, grad if wants_residual else None


def _linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None, bitwise: bool,
                    residual: Tensor | None = None) -> Tensor:
    """F.linear (plus `residual`), or with `bitwise` on CUDA the batch-invariant GEMM (`bitwise_kernels.matmul`):
    each output row's bits then depend on its own input row only, not on how many rows the batch has. Off bitwise
    mode and without a bias the residual joins the GEMM (addmm, beta 1: its epilogue reads it), which saves a
    separate addition's pass over the [T, out] activations."""
    if not (bitwise and x.is_cuda):
        if residual is None:
            return F.linear(x, weight, bias)
        if bias is None and x.dim() == residual.dim() == 2:
            return torch.addmm(residual, x, weight.t())
        return residual + F.linear(x, weight, bias)
    from shardrl.parallel.bitwise_kernels import matmul  # Triton: CUDA installs only

    y = matmul(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return y if residual is None else residual + y


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, bitwise: bool = False,
           residual: Tensor | None = None) -> Tensor:
    """F.linear, plus `residual` [..., out] where given (see `_linear_forward`); under autograd, for a weight with a
    fp32 `main_grad` (`GradBuffers`), its backward hands the weight gradient to `accumulate_weight_grad` (fused into
    main_grad on CUDA). `bitwise`: the forward GEMM is batch invariant (`_linear_forward`); the backward is the same
    either way."""
    if torch.is_grad_enabled() and weight.requires_grad and (hasattr(weight, "main_grad") or bitwise):
        return _Linear.apply(x, weight, bias, bitwise, residual)
    return _linear_forward(x, weight, bias, bitwise, residual)


def sharded_param(spec: ShardSpec, layout: Layout, dtype: torch.dtype) -> nn.Parameter:
    # Filled by the HF loader (or a test); allocation only, so huge models are never initialised twice.
    param = nn.Parameter(torch.empty(spec.local_shape(), device=layout.device, dtype=dtype))
    return set_spec(param, spec)


class ColumnParallelLinear(nn.Module):
    """y [T, out/n] = x [T, in] @ W_r^T + b_r with the output features split in `num_shards` (default: TP size).

    x must already be inside the TP region (`enter_tp`). `num_shards < tp` replicates shards over consecutive ranks
    (KV heads fewer than TP); their gradients are summed over the replicas from the spec.
    """

    def __init__(self, in_size: int, out_size: int, layout: Layout, name: str, bias: bool = False,
                 num_shards: int | None = None, dtype: torch.dtype = torch.float32, bitwise: bool = False) -> None:
        super().__init__()
        self.bitwise = bitwise
        num_shards = num_shards or layout.tp_size
        if out_size % num_shards:
            raise ValueError(f"{name}: output size {out_size} is not divisible by {num_shards} tensor-parallel shards")
        split = dict(dim=0, num_shards=num_shards, index=shard_index(layout, num_shards), group="tp")
        self.weight = sharded_param(ShardSpec(f"{name}.weight", (out_size, in_size), **split), layout, dtype)
        self.bias = sharded_param(ShardSpec(f"{name}.bias", (out_size,), **split), layout, dtype) if bias else None
        self.lora: nn.Module | None = None  # a LoRA adapter (`parallel.lora.attach_lora`): adds s * B (A x)
        # On the first linear of a group `pack_adjacent` packed: the group's weight and bias as one tensor each.
        self.packed: tuple[Tensor, Tensor | None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        return with_adapter(self, x, linear(x, self.weight, self.bias, self.bitwise))


def with_adapter(module: ColumnParallelLinear | RowParallelLinear, x: Tensor, y: Tensor) -> Tensor:
    """y plus the module's LoRA adapter applied to its input x, where it has an enabled one."""
    adapter = module.lora
    return y if adapter is None or not adapter.enabled else y + adapter(x)


def has_adapter(module: ColumnParallelLinear | RowParallelLinear) -> bool:
    return module.lora is not None and module.lora.enabled


def pack_adjacent(linears: Sequence[ColumnParallelLinear], device: torch.device) -> None:
    """Move the weights (and the biases) of `linears`, in order, into one new buffer each on `device`, so that
    `apply_columns` runs them as one GEMM.

    The params stay separate parameters, each its own HF tensor and shard spec, now views of the buffer: in-place
    loads (`load_hf_tensor`, weight sync) keep them packed; giving a param new `.data` (offload) unpacks it until
    the next call (call `unpack` then, which drops the packed views that would keep the old storage alive). Copies
    from wherever the data is (pinned host memory included), so an offloaded group comes back packed without a second
    copy on the device. The packed weight and bias are kept as views on the first linear (`packed`) for
    `apply_columns` under torch.compile, which cannot check storages.
    """
    for attr in ("weight", "bias"):
        params = [getattr(linear, attr) for linear in linears]
        if any(p is None for p in params):
            continue
        flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)
        offset = 0
        for param in params:
            piece = flat[offset:offset + param.numel()].view_as(param)
            piece.copy_(param.data, non_blocking=True)
            param.data = piece
            offset += param.numel()
    weight = _packed([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = None if any(b is None for b in biases) else _packed(biases)
    unbiased = all(b is None for b in biases)
    linears[0].packed = (weight, bias) if weight is not None and (unbiased or bias is not None) else None


def unpack(linears: Sequence[ColumnParallelLinear]) -> None:
    """Forget the packed views of a group whose params are about to get new `.data` (offload)."""
    linears[0].packed = None


def _packed(tensors: Sequence[Tensor]) -> Tensor | None:
    """The tensors stacked along dim 0 as one view, when they lie back to back in one storage (`pack_adjacent`);
    else None."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for tensor in tensors:
        if (tensor.untyped_storage().data_ptr() != storage or tensor.storage_offset() != offset
                or not tensor.is_contiguous() or tensor.shape[1:] != first.shape[1:] or tensor.dtype != first.dtype):
            return None
        offset += tensor.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def apply_columns(x: Tensor, linears: Sequence[ColumnParallelLinear]) -> list[Tensor]:
    """Every linear of `linears` on the same input x [T, in] -> [T, out_i/n] each.

    One GEMM (and one bias add) when they are packed (`pack_adjacent`) and autograd is off; else one each. With
    autograd the packed view would send the gradients of all of them to the first. Eagerly the storages are checked
    on every call; under torch.compile (`EngineConfig.compile_decode`), which cannot check them without breaking the
    graph and does not merge GEMMs itself, the views `pack_adjacent` kept are used (`unpack` drops them).
    """
    if len(linears) > 1 and not torch.is_grad_enabled():
        packed = linears[0].packed
        if not torch.compiler.is_compiling():
            weight = _packed([linear.weight for linear in linears])
            biases = [linear.bias for linear in linears]
            unbiased = all(b is None for b in biases)
            bias = None if unbiased or any(b is None for b in biases) else _packed(biases)
            packed = (weight, bias) if weight is not None and (unbiased or bias is not None) else None
        if packed is not None:
            out = _linear_forward(x, packed[0], packed[1], linears[0].bitwise)  # [T, sum of out_i/n]
            outs = out.split([linear.weight.shape[0] for linear in linears], dim=-1)
            return [with_adapter(linear, x, y) for linear, y in zip(linears, outs)]
    return [linear(x) for linear in linears]


class RowParallelLinear(nn.Module):
    """y = exit_tp(x_r [T, in/tp] @ W_r^T) + b: input features split over TP; the bias is added after the reduce."""

    def __init__(self, in_size: int, out_size: int, layout: Layout, name: str, bias: bool = False,
                 sequence_parallel: bool = False, dtype: torch.dtype = torch.float32, bitwise: bool = False) -> None:
        super().__init__()
        tp = layout.tp_size
        self.bitwise = bitwise
        if in_size % tp:
            raise ValueError(f"{name}: input size {in_size} is not divisible by tensor parallel size {tp}")
        self.group, self.sequence_parallel = layout.tp_group, sequence_parallel
        self.weight = sharded_param(ShardSpec(
            f"{name}.weight", (out_size, in_size), dim=1, num_shards=tp, index=layout.tp_rank, group="tp"),
            layout, dtype)
        # Replicated; with SP each rank adds it to its own tokens only, so its gradient is summed over TP.
        self.bias = sharded_param(ShardSpec(
            f"{name}.bias", (out_size,), sum_grad_over_group=sequence_parallel and tp > 1),
            layout, dtype) if bias else None
        self.lora: nn.Module | None = None  # a LoRA adapter: its B (A_r x_r) joins the partial sum before the reduce

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """The output, plus `residual` (the residual stream it joins) where given: without a TP group, a bias or a
        LoRA adapter, inside the GEMM (`linear`)."""
        if residual is not None and self.group is None and self.bias is None and not has_adapter(self):
            return linear(x, self.weight, bitwise=self.bitwise, residual=residual)
        y = with_adapter(self, x, linear(x, self.weight, bitwise=self.bitwise))
        y = exit_tp(y, self.group, self.sequence_parallel)  # [T or T/tp, out]
        y = y if self.bias is None else y + self.bias
        return y if residual is None else residual + y


class ReplicatedLinear(nn.Module):
    """A small linear kept whole on every TP rank (value head, shared-expert gate), applied to the tokens at hand."""

    def __init__(self, in_size: int, out_size: int, layout: Layout, name: str, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, bitwise: bool = False) -> None:
        super().__init__()
        self.bitwise = bitwise
        # With SP each rank sees only its own tokens, so the gradient is a partial sum over TP.
        self.weight = sharded_param(ShardSpec(
            f"{name}.weight", (out_size, in_size), sum_grad_over_group=sequence_parallel and layout.tp_size > 1),
            layout, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, bitwise=self.bitwise)
