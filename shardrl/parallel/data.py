"""Gradient accumulation buffers and gradient finalisation over shard groups (TP / ETP), tied embeddings and data
parallel.

Choices (read by the optimizer, offload and checkpoint code):

* Gradients accumulate in fp32 whatever the parameter dtype. Every trainable parameter gets ``param.main_grad``, a
  view into a flat fp32 buffer; a post-accumulate-grad hook adds each backward's ``param.grad`` into it and drops
  ``param.grad``. So micro batches of a bf16 model accumulate in fp32, and the data-parallel reduction runs in place
  on the flat buffers with no copies. The linears' weight-gradient GEMMs on CUDA skip ``param.grad`` altogether and
  add into ``main_grad`` themselves (`accumulate_weight_grad`): no bf16 gradient is rounded or stored, and the
  separate addition pass is gone. The experts' grouped GEMMs have no fp32 output: their backward adds each bf16
  weight gradient into ``main_grad`` at once (`add_into_main_grad`, one vectorised pass on CUDA), again with no
  ``param.grad`` and no hook. Embeddings add their rows' gradients into ``main_grad``'s rows
  (`accumulate_embedding_grad`): the dense vocabulary-sized gradient is never formed.
* Buffers are keyed by (data-parallel group, parameter dtype, weight decay): dense parameters reduce over
  ``"dp_cp"``, expert parameters (``spec.expert``) over ``"edp"``; the dtype is the one updated values are gathered
  in by the distributed optimizer; weight decay is off for parameters whose HF tensor is 1-D (norms, biases) and is
  then one scalar per buffer.
* A buffer is cut into buckets of about ``bucket_mb``, one collective each; a parameter never spans two buckets, and
  each bucket is padded (with zeros that stay zero) to a multiple of ``ALIGN * dp`` so every rank's 1/dp chunk of it
  is aligned. Data parallel SUMS: losses are already divided by global counts (DESIGN.md, loss normalisation).
* ``shard=True`` (distributed optimizer): the reduction is a reduce-scatter per bucket; after `finalize` only this
  rank's chunk of each bucket holds the reduced gradient (the rest holds stale local sums).
* Everything is routed by each parameter's ShardSpec (see spec.py), never by names.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardrl.parallel.collectives import reduce_scatter_single
from shardrl.parallel.layout import Layout
from shardrl.parallel.spec import ShardSpec, get_spec

ALIGN = 64  # elements; each rank's chunk of a bucket starts 256 bytes aligned (fp32)
# cuBLAS takes vector lengths as 32-bit ints: one `torch.dot` of a longer piece (a 2B-parameter buffer on one rank,
# e.g. MoE experts at EP 1) fails on GPU, so the norm walks longer pieces in slices of at most this many elements.
DOT_MAX_ELEMENTS = 2**31 - 1


FUSED_GRAD_DTYPES = (torch.bfloat16, torch.float16)  # inputs cuBLAS multiplies into an fp32 main_grad in place


@dataclass
class _Accumulation:
    """Whether backward may still add into a GradBuffers' buffers; shared by its params (``param.grad_accumulation``)
    so that the fused weight-gradient GEMMs refuse a backward after `finalize`, as the hook does."""

    finalized: bool = False


def _check_open(param: nn.Parameter) -> None:
    if param.grad_accumulation.finalized:
        raise RuntimeError(f"{get_spec(param).hf_name}: backward after finalize(); call zero() (zero_grad) first")


def accumulate_weight_grad(weight: nn.Parameter, grad: Tensor, x: Tensor) -> Tensor | None:
    """The weight gradient grad^T @ x of y = x @ W^T (grad [N, out], x [N, in]) for a linear's backward.

    Where `weight` has a `GradBuffers` main_grad on the same CUDA device and the inputs are bf16/fp16, one GEMM adds
    it into main_grad with fp32 output (cuBLAS's beta = 1) and None is returned, so autograd holds no gradient for
    the weight. Otherwise the gradient is returned (autograd accumulates it; the hook then adds it to main_grad).
    On one H200 the fused GEMM is 1.08-1.13x the GEMM plus the separate addition, and its result is as exact as
    fp32 accumulation allows (relative error 1e-5, against 2e-3 after rounding each micro batch's gradient to bf16).
    """
    main = getattr(weight, "main_grad", None)
    if (main is None or not grad.is_cuda or main.device != grad.device or grad.dtype not in FUSED_GRAD_DTYPES
            or x.dtype != grad.dtype):
        return grad.t().mm(x)
    _check_open(weight)
    torch.addmm(main, grad.t(), x, out_dtype=torch.float32, out=main)
    return None


def fills_main_grad(weight: Tensor) -> bool:
    """Whether a backward now would add `weight`'s gradient into its `GradBuffers` main_grad itself: the test by
    which the embedding and the experts' GEMMs pick their autograd functions (inference keeps torch's ops)."""
    return torch.is_grad_enabled() and weight.requires_grad and hasattr(weight, "main_grad")


def accumulate_embedding_grad(weight: nn.Parameter, ids: Tensor, grad: Tensor) -> Tensor | None:
    """The weight gradient of rows = weight[ids] (ids [T], grad [T, H]) for an embedding's backward.

    Where `weight` has a `GradBuffers` main_grad on grad's device, each row's gradient is added into its main_grad
    row in fp32 and None is returned, so the dense [V, H] gradient that torch's embedding backward writes (zeroed,
    filled, then added into main_grad by the hook: over 3 GB of traffic per micro batch at a 128k vocabulary) is
    never formed. Deterministic on both devices: CUDA's accumulating `index_put_` sums the duplicates of an id after
    sorting, with no atomics; on CPU, where that op may run threads in any order, `index_add_` adds in token order.
    Otherwise that dense gradient is returned for autograd."""
    main = getattr(weight, "main_grad", None)
    if main is None or main.device != grad.device:
        return torch.ops.aten.embedding_dense_backward(grad, ids, weight.shape[0], -1, False)
    _check_open(weight)
    rows = grad.to(main.dtype)
    if main.is_cuda:
        main.index_put_((ids,), rows, accumulate=True)
    else:
        main.index_add_(0, ids, rows)
    return None


def add_into_main_grad(weight: nn.Parameter, grad: Tensor) -> Tensor | None:
    """Add a weight gradient that a backward computed as its own tensor (the experts' grouped GEMMs have no fp32
    output) into `weight.main_grad` now and return None, so autograd stores nothing and runs no hook; without a
    `GradBuffers` main_grad the gradient is returned for autograd to accumulate."""
    main = getattr(weight, "main_grad", None)
    if main is None:
        return grad
    _check_open(weight)
    _add_into(main, grad)
    return None


def _add_into(main: Tensor, grad: Tensor) -> None:
    """main (fp32) += grad: on CUDA for a bf16/fp16 gradient one vectorised pass (`grad_add_kernel`: torch's
    mixed-dtype addition loads one element at a time), elsewhere torch's."""
    if (grad.is_cuda and main.device == grad.device and grad.dtype in FUSED_GRAD_DTYPES
            and main.dtype == torch.float32 and grad.shape == main.shape and main.is_contiguous()
            and grad.is_contiguous()):
        from shardrl.parallel.grad_add_kernel import add_into_fp32  # Triton: CUDA installs only

        add_into_fp32(main, grad)
    else:
        main.add_(grad)


@dataclass
class GradBuffer:
    """One flat fp32 gradient buffer: parameters sharing a data-parallel group, a dtype and a weight-decay choice."""

    group_name: str  # "dp_cp" (dense) or "edp" (experts)
    dtype: torch.dtype  # the parameters' dtype
    decay: bool
    params: list[nn.Parameter]
    offsets: list[int]  # start of each parameter in `data`
    param_bucket: list[int]  # bucket index of each parameter
    buckets: list[tuple[int, int]]  # [start, end) of each bucket in `data`, back to back from 0
    data: Tensor  # [numel] fp32

    def chunk(self, bucket: int, rank: int, count: int) -> tuple[int, int]:
        """[start, end) in `data` of the `rank`-th of `count` equal chunks of bucket `bucket`."""
        start, end = self.buckets[bucket]
        size = (end - start) // count
        return start + rank * size, start + (rank + 1) * size

    def pieces(self, rank: int, count: int) -> list[tuple[int, int, int, int]]:
        """(param index, start, end, chunk start): the part [start, end) of each param that lies in chunk `rank`
        of `count` of its bucket, in positions of `data`; params wholly outside their chunk are left out."""
        out = []
        for i, (param, offset, bucket) in enumerate(zip(self.params, self.offsets, self.param_bucket)):
            lo, hi = self.chunk(bucket, rank, count)
            start, end = max(offset, lo), min(offset + param.numel(), hi)
            if start < end:
                out.append((i, start, end, lo))
        return out


def shard_group(spec: ShardSpec) -> str:
    """The layout group a parameter is sharded or replicated over (the spec's, else TP for dense, ETP for experts)."""
    return spec.group or ("etp" if spec.expert else "tp")


def counts_in_norm(spec: ShardSpec, layout: Layout) -> bool:
    """Whether this rank holds the primary copy of its shard (so the grad norm counts every element once).

    Replicated over the shard group: its rank 0; shards with fewer shards than ranks: the first replica; tied
    embeddings: the first pipeline stage. Data-parallel replicas are split by `GradBuffers` instead.
    """
    if spec.tied_group and not layout.is_first_stage:
        return False
    group = shard_group(spec)
    rank = layout.rank(group)
    if spec.dim is None:
        return rank == 0
    return rank % (layout.size(group) // spec.num_shards) == 0


def _check_spec(spec: ShardSpec, layout: Layout) -> None:
    group = shard_group(spec)
    if spec.dim is None:
        return
    if spec.sum_grad_over_group:
        raise ValueError(f"{spec.hf_name}: sum_grad_over_group is for replicated params, but dim={spec.dim}")
    size, rank = layout.size(group), layout.rank(group)
    if spec.num_shards > size or size % spec.num_shards:
        raise ValueError(f"{spec.hf_name}: num_shards={spec.num_shards} does not divide group {group!r} of size {size}")
    if spec.index != rank // (size // spec.num_shards):
        raise ValueError(f"{spec.hf_name}: spec index {spec.index}, but rank {rank} of group {group!r} holds shard "
                         f"{rank // (size // spec.num_shards)} of {spec.num_shards}")


def _build_buffer(key: tuple[str, torch.dtype, bool], params: list[nn.Parameter], bucket_numel: int,
                  dp: int) -> GradBuffer:
    pad = ALIGN * dp
    offsets, param_bucket, buckets = [], [], []
    start = end = 0
    for param in params:
        offsets.append(end)
        param_bucket.append(len(buckets))
        end += param.numel()
        if end - start >= bucket_numel or param is params[-1]:
            end = -(-end // pad) * pad
            buckets.append((start, end))
            start = end
    data = torch.zeros(end, dtype=torch.float32, device=params[0].device)
    for param, offset in zip(params, offsets):
        param.main_grad = data[offset:offset + param.numel()].view(param.shape)
    return GradBuffer(*key, params, offsets, param_bucket, buckets, data)


def _all_reduce_coalesced(tensors: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum each tensor over `group` with one collective."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    pieces = flat.split([t.numel() for t in tensors])
    torch._foreach_copy_(tensors, [piece.view_as(t) for t, piece in zip(tensors, pieces)])


def _sum_over_replicas(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum shards held by several ranks of `group` (num_shards < group size) over exactly their replicas.

    Each rank writes its shard into its slot of a zeroed buffer with room for every shard; after one all-reduce a
    slot holds the sum over the ranks that hold that shard, as the others contributed zeros there.
    """
    if group is None or not params:
        return
    specs = [get_spec(p) for p in params]
    sizes = [p.numel() * s.num_shards for p, s in zip(params, specs)]
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=params[0].main_grad.device)
    slots = [piece.view(s.num_shards, -1)[s.index] for piece, s in zip(flat.split(sizes), specs)]
    torch._foreach_copy_(slots, [param.main_grad.reshape(-1) for param in params])
    dist.all_reduce(flat, group=group)
    torch._foreach_copy_([param.main_grad for param in params], [slot.view_as(param.main_grad)
                                                                  for param, slot in zip(params, slots)])


class GradBuffers:
    """fp32 gradient buffers of a model's trainable parameters and their finalisation (see the module docstring).

    Usage: build once (before the first backward), then per optimizer step `zero()`, backward over all micro
    batches, `finalize()`; read ``param.main_grad``. `finalize` is idempotent until the next `zero`.
    """

    def __init__(self, params: Iterable[nn.Parameter], layout: Layout, *, bucket_mb: float = 40.0,
                 shard: bool = False) -> None:
        self.layout, self.shard = layout, shard
        grouped: dict[tuple[str, torch.dtype, bool], list[nn.Parameter]] = {}
        for param in params:
            if not param.requires_grad:
                continue
            spec = get_spec(param)
            if hasattr(param, "main_grad"):
                raise ValueError(f"{spec.hf_name}: already has a gradient buffer (one GradBuffers per parameter)")
            _check_spec(spec, layout)
            key = ("edp" if spec.expert else "dp_cp", param.dtype, len(spec.full_shape) >= 2)
            grouped.setdefault(key, []).append(param)
        bucket_numel = max(int(bucket_mb * 2**20) // 4, 1)
        self.buffers = [_build_buffer(key, ps, bucket_numel, layout.size(key[0])) for key, ps in grouped.items()]
        self.params = [p for buf in self.buffers for p in buf.params]
        self._partial: dict[str, list[nn.Parameter]] = {}  # shard group -> params whose ranks sum their grads
        for p in self.params:
            if get_spec(p).sum_grad_over_group:
                self._partial.setdefault(shard_group(get_spec(p)), []).append(p)
        self._replicated: dict[str, list[nn.Parameter]] = {}
        for p in self.params:
            spec = get_spec(p)
            if spec.dim is not None and spec.num_shards < layout.size(shard_group(spec)):
                self._replicated.setdefault(shard_group(spec), []).append(p)
        self._tied = [p for p in self.params if get_spec(p).tied_group]
        self._norm_ranges = [self._counted_ranges(buf) for buf in self.buffers]
        self._state = _Accumulation()
        # The hooks live in the params' C++ side, where Python's garbage collector cannot see them: a hook holding
        # these buffers (which hold the params) would keep a dropped model and its gradients alive for good. They
        # hold a weak reference instead (a GradBuffers outlives every backward of its params).
        owner = weakref.ref(self)
        for p in self.params:
            p.grad_accumulation = self._state
            p.register_post_accumulate_grad_hook(lambda param: owner()._accumulate(param))

    def _accumulate(self, param: nn.Parameter) -> None:
        _check_open(param)
        if param.grad is None:  # the weight-gradient GEMM already added into main_grad (autograd got None)
            return
        _add_into(param.main_grad, param.grad)
        param.grad = None

    def owner(self, buf: GradBuffer) -> tuple[int, int]:
        """(rank, count): this rank owns chunk `rank` of `count` of every bucket (the whole bucket unless sharded)."""
        if not self.shard:
            return 0, 1
        return self.layout.rank(buf.group_name), self.layout.size(buf.group_name)

    def fragments(self, buf: GradBuffer) -> list[tuple[nn.Parameter, int, int, int]]:
        """(param, lo, hi, pos): this rank owns elements [lo, hi) of the flattened param, at `pos` of the flat
        owned-state tensor (the owned chunks of all buckets, back to back)."""
        rank, count = self.owner(buf)
        out = []
        for i, start, end, lo in buf.pieces(rank, count):
            offset, bucket_start = buf.offsets[i], buf.buckets[buf.param_bucket[i]][0]
            out.append((buf.params[i], start - offset, end - offset, bucket_start // count + start - lo))
        return out

    def _counted_ranges(self, buf: GradBuffer) -> list[tuple[int, int]]:
        # Data-parallel replicas: each rank counts its 1/dp chunk of every bucket (sharded or not, so the norm is
        # the same number in both modes); within it, only the params whose primary copy this rank holds.
        ranges: list[tuple[int, int]] = []
        for i, start, end, _ in buf.pieces(self.layout.rank(buf.group_name), self.layout.size(buf.group_name)):
            if not counts_in_norm(get_spec(buf.params[i]), self.layout):
                continue
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
        return ranges

    def zero(self) -> None:
        for buf in self.buffers:
            buf.data.zero_()
        for param in self.params:  # left over only if a backward failed between accumulation and the hook
            param.grad = None
        self._state.finalized = False

    @torch.no_grad()
    def finalize(self) -> None:
        """Sum gradients over the shard group (TP / ETP) where the spec asks, over tied copies, then over data
        parallel (see module doc)."""
        if self._state.finalized:
            return
        layout = self.layout
        for name, params in self._partial.items():
            _all_reduce_coalesced([p.main_grad for p in params], layout.group(name))
        for name, params in self._replicated.items():
            _sum_over_replicas(params, layout.group(name))
        _all_reduce_coalesced([p.main_grad for p in self._tied], layout.embedding_group)
        for buf in self.buffers:
            self._reduce_data_parallel(buf)
        self._state.finalized = True

    def _reduce_data_parallel(self, buf: GradBuffer) -> None:
        group = self.layout.group(buf.group_name)
        if group is None:
            return
        rank, count = self.owner(buf)
        for bucket, (start, end) in enumerate(buf.buckets):
            if self.shard:
                lo, hi = buf.chunk(bucket, rank, count)
                reduce_scatter_single(buf.data[lo:hi], buf.data[start:end], group=group)
            else:
                dist.all_reduce(buf.data[start:end], group=group)

    @torch.no_grad()
    def global_norm(self) -> Tensor:
        """L2 norm of the finalised gradient of the whole model over all ranks of the layout, each element once."""
        device = self.buffers[0].data.device if self.buffers else self.layout.device
        square_sum = torch.zeros((), dtype=torch.float32, device=device)
        for buf, ranges in zip(self.buffers, self._norm_ranges):
            for start, end in ranges:
                square_sum += sum_of_squares(buf.data[start:end])
        # (tp, pp) then (cp, dp): together every rank of the layout, without a dedicated group.
        for name in ("mp", "dp_cp"):
            group = self.layout.group(name)
            if group is not None:
                dist.all_reduce(square_sum, group=group)
        return square_sum.sqrt()

    def tensors(self) -> list[Tensor]:
        """The flat buffers (what offloading grads moves)."""
        return [buf.data for buf in self.buffers]


def sum_of_squares(vector: Tensor, max_elements: int = DOT_MAX_ELEMENTS) -> Tensor:
    """Sum of the squares of a 1-D tensor as dot products over slices of at most `max_elements` (cuBLAS's bound)."""
    return sum(torch.dot(piece, piece) for piece in vector.split(max_elements))
