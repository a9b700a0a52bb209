"""The copies of a weight sync, issued in as few launches as possible, and reads of offloaded params from host memory.

A sync copies hundreds of small pieces (trainer shards -> buckets, buckets -> rollout shards, shards kept in place).
One `copy_` each made the host, not the GPU or the link, the bottleneck (~12 us of launch per piece), so the copies
are collected in a `CopyBatch` and issued together: small pairs that are contiguous, of one dtype and on one device
go through one multi-tensor copy per dtype (`torch._foreach_copy_`: a launch per few dozen tensors), the rest one
`copy_` each: column blocks, dtype changes, host -> device DMA, and contiguous pieces of at least
`MEMCPY_MIN_BYTES`, which `copy_` hands to the copy engine (cudaMemcpyAsync) at full bandwidth. The multi-tensor
kernel moves big tensors at a fraction of that: a one-GPU sync of 6.2 GB of Qwen2.5-3B weights (434 pieces, one
foreach launch) took 14.8 ms where one device copy of the same bytes takes 2.9 ms (H200, docs/benchmarks.md).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

MEMCPY_MIN_BYTES = 1 << 20  # a piece this big pays its own launch (~10 us host) to move at copy-engine bandwidth


class CopyBatch:
    """`dst.copy_(src)` for every added pair, issued at `flush` (stream order is that of the flush)."""

    def __init__(self) -> None:
        self.dsts: list[Tensor] = []
        self.srcs: list[Tensor] = []
        self.launches = 0  # copy calls issued so far (a foreach call counts once): what the host paid for

    def add(self, dst: Tensor, src: Tensor) -> None:
        self.dsts.append(dst)
        self.srcs.append(src)

    def replay(self) -> CopyReplay:
        """The pending copies grouped into launches, not issued; the batch is left empty."""
        replay = CopyReplay(self.dsts, self.srcs)
        self.dsts, self.srcs = [], []
        return replay

    def flush(self) -> CopyReplay:
        """Issue the pending copies; returns them grouped as issued, to issue again (`CopyReplay`)."""
        replay = self.replay()
        self.launches += replay.issue()
        return replay


class CopyReplay:
    """A set of copies grouped into launches once (the grouping walks every pair in Python), issued any number of
    times: the local copies of a resident sync are the same views every sync. On CUDA, `record` captures them in a
    CUDA graph and drops the tensors, after which an issue is one launch (memcpy nodes at copy-engine speed) instead
    of one per big piece: the caller checks that the tensors' memory is where it was before each issue.
    """

    def __init__(self, dsts: list[Tensor], srcs: list[Tensor]) -> None:
        self.singles: list[tuple[Tensor, Tensor]] = []
        groups: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
        for dst, src in zip(dsts, srcs):
            if (dst.dtype == src.dtype and dst.device == src.device and dst.is_contiguous() and src.is_contiguous()
                    and dst.numel() * dst.element_size() < MEMCPY_MIN_BYTES):
                group_dsts, group_srcs = groups.setdefault(dst.dtype, ([], []))
                group_dsts.append(dst.view(-1))
                group_srcs.append(src.view(-1))
            else:
                self.singles.append((dst, src))
        self.groups = list(groups.values())
        self.graph: torch.cuda.CUDAGraph | None = None

    def issue(self) -> int:
        """Issue every copy on the current stream; returns the launches (a multi-tensor copy counts once)."""
        if self.graph is not None:
            self.graph.replay()
            return 1
        for dst, src in self.singles:
            dst.copy_(src, non_blocking=True)
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        return len(self.singles) + len(self.groups)

    def record(self) -> None:
        """Capture the copies into a CUDA graph on the current (non-default) stream and let go of the tensors: the
        graph copies between their addresses, which the caller checks before each issue. Nothing is copied yet;
        the copies allocate nothing, so the graph needs no memory pool beyond the capture's bookkeeping."""
        if self.graph is not None or not (self.singles or self.groups):
            return
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            self.issue()
        finally:
            graph.capture_end()
        self.graph, self.singles, self.groups = graph, [], []


class HostStaging:
    """Device copies of whole offloaded params, least recently used first out within `budget` bytes.

    A param of which this rank reads a column block or a converted dtype (anything not a contiguous run of the wire
    dtype) is copied to the device whole, once, and every piece this rank needs of it (sent or kept) is cut from
    that copy: an expert matrix split by columns between two rollout ranks crosses PCIe once, not twice. On CPU the
    "device" is host memory too, yet the staging copy is still made, so the CPU tests run (and count) the GPU's path.
    """

    def __init__(self, device: torch.device, budget: int) -> None:
        self.device, self.budget = device, budget
        self.staged: OrderedDict[int, Tensor] = OrderedDict()  # host storage address -> its bytes on the device
        self.staged_bytes = 0  # sum of the staged copies' sizes
        self.read_bytes = 0  # bytes read from host copies of offloaded params so far (what PCIe carried on GPU)

    def has(self, src: Tensor) -> bool:
        return src.untyped_storage().data_ptr() in self.staged

    def view(self, src: Tensor) -> Tensor:
        """`src` (a view of an offloaded param's host copy) as the same view of its device copy, staged on a miss.
        The caller flushes pending copies before a miss, so an evicted copy is no longer referenced."""
        storage = src.untyped_storage()
        staged = self.staged.pop(storage.data_ptr(), None)
        if staged is None:
            while self.staged and self.staged_bytes + storage.nbytes() > self.budget:
                # Freed on the current stream: the copies already queued from it run first.
                self.staged_bytes -= self.staged.popitem(last=False)[1].numel()
            host = torch.empty(0, dtype=torch.uint8).set_(storage)  # [nbytes] the whole host storage
            staged = torch.empty_like(host, device=self.device).copy_(host, non_blocking=True)
            self.read_bytes += host.numel()
            self.staged_bytes += staged.numel()
        self.staged[storage.data_ptr()] = staged
        return staged.view(src.dtype).as_strided(src.shape, src.stride(), src.storage_offset())

    def clear(self) -> None:
        """Drop every staged copy (at the end of a sync, once the copies cut from them are queued)."""
        self.staged.clear()
        self.staged_bytes = 0

    def direct(self, src: Tensor) -> Tensor:
        """A contiguous host run of the wire dtype, DMA'd straight into its destination: counted, not staged."""
        self.read_bytes += src.numel() * src.element_size()
        return src
