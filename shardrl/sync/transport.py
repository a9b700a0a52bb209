"""Execute one rank's share of a `SyncPlan`: local copies, and buckets sent and received over the sync group.

Double-buffered pipeline, one iteration per step this rank takes part in:
    pack bucket i into send buffer i%2 (trainer shards -> bucket, from the device or pinned host memory) + checksum
    post step i (isend / irecv, batched so no pair can deadlock)
    finish step i-1: wait, checksum the received bucket, copy its pieces into the rollout shards
    a share of the local (same-rank) copies
so packing, the transfer in flight and unpacking overlap (on GPU: the NCCL stream against the compute stream; with
gloo: the background transport against this thread). A buffer is reused only after the step that used it two
iterations earlier finished. Peak extra memory: the two buffers per direction (a bucket each, half a bucket each
for a rank that both sends and receives; checksum scratch included) and, for offloaded params read in strided
or converted pieces, staged params up to the size of the largest one (`HostStaging`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from shardrl.sync.plan import TRAILER_BYTES, Bucket, Piece, RankPlan
from shardrl.sync.shards import Shards
from shardrl.sync.verify import check_checksums, check_full, checksum


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    buckets: int = 0
    buffer_bytes: int = 0


class HostStaging:
    """Device copies of offloaded params, least recently used first out within `budget` bytes.

    A piece that is contiguous in pinned host memory and already of the wire dtype is copied straight into its
    bucket (one asynchronous DMA). Any other read of an offloaded param (a column block, a dtype change) stages the
    whole param on the device once, and every piece cut from it while it stays staged is a device copy: an expert
    matrix split by columns for two rollout ranks crosses PCIe once, not twice.
    """

    def __init__(self, device: torch.device, budget: int) -> None:
        self.device, self.budget = device, budget
        self.staged: OrderedDict[int, Tensor] = OrderedDict()  # host storage address -> its bytes on the device

    def view(self, src: Tensor) -> Tensor:
        """`src` (a view of an offloaded param's host copy) as the same view of its device copy."""
        storage = src.untyped_storage()
        staged = self.staged.pop(storage.data_ptr(), None)
        if staged is None:
            while self.staged and sum(t.numel() for t in self.staged.values()) + storage.nbytes() > self.budget:
                # Freed on the current stream: the copies already queued from it run first.
                self.staged.popitem(last=False)
            host = torch.empty(0, dtype=torch.uint8).set_(storage)  # [nbytes] the whole pinned storage
            staged = torch.empty_like(host, device=self.device).copy_(host, non_blocking=True)
        self.staged[storage.data_ptr()] = staged
        return staged.view(src.dtype).as_strided(src.shape, src.stride(), src.storage_offset())

    def copy(self, dst: Tensor, src: Tensor) -> None:
        """`dst.copy_(src)`, staging a host `src` that cannot be DMA'd straight into `dst`."""
        if src.device != dst.device and not (src.is_contiguous() and src.dtype == dst.dtype):
            src = self.view(src)
        dst.copy_(src, non_blocking=True)


def piece_view(buf: Tensor, piece: Piece) -> Tensor:
    return buf[piece.offset:piece.offset + piece.nbytes].view(piece.dtype).view(piece.shape)


class Transport:
    def __init__(self, plan: RankPlan, group: dist.ProcessGroup | None, device: torch.device,
                 source: Shards | None, target: Shards | None) -> None:
        self.plan, self.group, self.device = plan, group, device
        self.source, self.target = source, target
        # Staging for offloaded params: at most the largest one (the "+ largest tensor" of the memory bound).
        self.staging = HostStaging(device, source.largest_bytes() if source else 0)

    def _buffers(self, buckets: Sequence[Bucket]) -> list[Tensor]:
        if not buckets:
            return []
        size = max(b.nbytes for b in buckets) + TRAILER_BYTES
        return [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(min(2, len(buckets)))]

    def pack(self, bucket: Bucket, buf: Tensor) -> Tensor:
        """Fill `buf` with the bucket's pieces and their checksum; returns the bytes to send."""
        for piece in bucket.pieces:
            self.staging.copy(piece_view(buf, piece), self.source.view(piece.hf_name, piece.box))
        n = bucket.nbytes
        buf[n:n + TRAILER_BYTES].view(torch.int64).copy_(checksum(buf[:n]))
        return buf[:n + TRAILER_BYTES]

    def unpack(self, bucket: Bucket, buf: Tensor, sums: Tensor, compare: list | None) -> None:
        """Check a received bucket into `sums` [2, 2] and load its pieces (verify=full: compare them instead)."""
        n = bucket.nbytes
        sums[0] = buf[n:n + TRAILER_BYTES].view(torch.int64)
        sums[1] = checksum(buf[:n])
        for piece in bucket.pieces:
            dst = self.target.view(piece.hf_name, piece.box)
            if compare is None:
                dst.copy_(piece_view(buf, piece), non_blocking=True)
            else:
                compare.append((piece.name, (dst != piece_view(buf, piece)).any()))

    def _copy_local(self, pieces: Sequence[Piece], compare: list | None) -> None:
        for piece in pieces:
            dst, src = self.target.view(piece.hf_name, piece.box), self.source.view(piece.hf_name, piece.box)
            if compare is None:
                self.staging.copy(dst, src)
            else:
                compare.append((piece.name, (dst != src.to(dst.device, dst.dtype)).any()))

    def run(self, compare: bool = False) -> TransferStats:
        """One pass over the plan (see the module docstring). `compare`: verify=full, nothing is written."""
        plan = self.plan
        send_bufs, recv_bufs = self._buffers(plan.sends), self._buffers(plan.recvs)
        sums = torch.zeros(len(plan.recvs), 2, 2, dtype=torch.int64, device=self.device)
        compared: list | None = [] if compare else None
        sends = {b.step: b for b in plan.sends}
        recvs = {b.step: (i, b) for i, b in enumerate(plan.recvs)}
        steps = sorted(sends.keys() | recvs.keys())
        local = _spread(plan.local, len(steps) + 1)
        in_flight, num_sent = None, 0
        for step in steps:
            ops = []
            if step in sends:
                bucket = sends[step]
                wire = self.pack(bucket, send_bufs[num_sent % 2])
                num_sent += 1
                ops.append(dist.P2POp(dist.isend, wire, bucket.dst, self.group))
            recv = recvs.get(step)
            if recv is not None:
                i, bucket = recv
                wire = recv_bufs[i % 2][:bucket.nbytes + TRAILER_BYTES]
                ops.append(dist.P2POp(dist.irecv, wire, bucket.src, self.group))
            works = dist.batch_isend_irecv(ops)
            if in_flight is not None:
                self._finish(*in_flight, recv_bufs, sums, compared)
            in_flight = (works, recv)
            self._copy_local(next(local), compared)
        if in_flight is not None:
            self._finish(*in_flight, recv_bufs, sums, compared)
        self._copy_local(next(local), compared)
        self.staging.staged.clear()
        check_checksums(plan.recvs, sums)
        if compared is not None:
            check_full([name for name, _ in compared], [flag for _, flag in compared], plan.rank)
        return TransferStats(sum(b.nbytes for b in plan.sends), sum(b.nbytes for b in plan.recvs),
                             sum(p.nbytes for p in plan.local), len(plan.sends) + len(plan.recvs),
                             sum(b.numel() for b in send_bufs + recv_bufs))

    def _finish(self, works: list, recv: tuple[int, Bucket] | None, recv_bufs: list[Tensor], sums: Tensor,
                compared: list | None) -> None:
        for work in works:
            work.wait()
        if recv is not None:
            i, bucket = recv
            self.unpack(bucket, recv_bufs[i % 2], sums[i], compared)


def _spread(pieces: Sequence[Piece], parts: int) -> Iterator[list[Piece]]:
    """`pieces` in `parts` consecutive runs of about equal bytes (the local copies done between steps)."""
    total = sum(p.nbytes for p in pieces)
    done, start = 0, 0
    for part in range(1, parts + 1):
        end = start
        while end < len(pieces) and done * parts < total * part:
            done += pieces[end].nbytes
            end += 1
        yield list(pieces[start:end])
        start = end
