"""Execute one rank's share of a `SyncPlan`: local copies, and buckets sent and received over the sync group.

Double-buffered pipeline, one iteration per step this rank takes part in:
    pack bucket i into the next free send buffer (trainer shards -> bucket, from the device or pinned host memory)
        and append its checksum
    post step i (isend / irecv, batched so no pair can deadlock)
    finish step i-1: wait, free its send buffer, checksum the received bucket, copy its pieces into the rollout
        shards, free its receive buffer
    a share of the local (same-rank) copies
so packing, the transfer in flight and unpacking overlap. On GPU everything that reads the trainer's shards
(packing, local copies: device copies or pinned host -> device DMA) runs on a side stream, the transfer on NCCL's
stream and the unpacking on the current stream, so PCIe, NVLink and HBM work at once; CUDA events order them. With
gloo the transfer runs in gloo's background threads against this thread. Each direction has two buffers handed out
in turn (`Ring`); a buffer is written again only after the step that used it finished (and, on GPU, the writing
stream waits for the event marking that). Peak extra memory: the buffers (a bucket each, half a bucket each for a
rank that both sends and receives) and, for offloaded params read in strided or converted pieces, staged params up
to the size of the largest one (`HostStaging`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from shardrl.sync.plan import CHECKSUM_WORDS, TRAILER_BYTES, Bucket, Piece, RankPlan
from shardrl.sync.shards import Shards
from shardrl.sync.verify import check_checksums, check_full, checksum


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    buckets: int = 0
    buffer_bytes: int = 0
    host_read_bytes: int = 0  # crossed from pinned host memory (offloaded params), staged params counted whole


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
        self.read_bytes = 0  # host -> device bytes so far: what PCIe carried (0 on CPU: host and device are one)

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
            self.read_bytes += host.numel()
        self.staged[storage.data_ptr()] = staged
        return staged.view(src.dtype).as_strided(src.shape, src.stride(), src.storage_offset())

    def copy(self, dst: Tensor, src: Tensor) -> None:
        """`dst.copy_(src)`, staging a host `src` that cannot be DMA'd straight into `dst`."""
        if src.device != dst.device and not (src.is_contiguous() and src.dtype == dst.dtype):
            src = self.view(src)
        elif src.device != dst.device:
            self.read_bytes += src.numel() * src.element_size()
        dst.copy_(src, non_blocking=True)


class BufferInFlightError(RuntimeError):
    """The pipeline tried to write a buffer whose transfer had not finished (a bug in the step ordering)."""


class Ring:
    """Buffers handed out in turn. `acquire` returns the next one only once `release` marked the end of its last use
    (the transfer that read or wrote it finished); on GPU `release` also takes the event recorded at that point,
    and `acquire(stream)` makes the writing stream wait for it."""

    def __init__(self, buffers: Sequence[Tensor]) -> None:
        self.buffers = list(buffers)
        self.count = 0
        self.in_use = [False] * len(self.buffers)
        self.freed: list[torch.cuda.Event | None] = [None] * len(self.buffers)

    def acquire(self, stream: torch.cuda.Stream | None = None) -> tuple[int, Tensor]:
        slot = self.count % len(self.buffers)
        if self.in_use[slot]:
            raise BufferInFlightError(f"weight sync: buffer {slot} of {len(self.buffers)} is needed for use "
                                      f"{self.count} but use {self.count - len(self.buffers)} is still in flight")
        if stream is not None and self.freed[slot] is not None:
            stream.wait_event(self.freed[slot])
        self.in_use[slot], self.count = True, self.count + 1
        return slot, self.buffers[slot]

    def release(self, slot: int, event: torch.cuda.Event | None = None) -> None:
        self.in_use[slot], self.freed[slot] = False, event


def piece_view(buf: Tensor, piece: Piece) -> Tensor:
    return buf[piece.offset:piece.offset + piece.nbytes].view(piece.dtype).view(piece.shape)


class Transport:
    def __init__(self, plan: RankPlan, group: dist.ProcessGroup | None, device: torch.device,
                 source: Shards | None, target: Shards | None) -> None:
        self.plan, self.group, self.device = plan, group, device
        self.source, self.target = source, target
        # Staging for offloaded params: at most the largest one (the "+ largest tensor" of the memory bound).
        self.staging = HostStaging(device, source.largest_bytes() if source else 0)
        # Made once: the allocator keeps the side stream's blocks (staged params) for reuse by later syncs.
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _buffers(self, buckets: Sequence[Bucket]) -> Ring:
        if not buckets:
            return Ring([])
        size = max(b.nbytes for b in buckets) + TRAILER_BYTES
        return Ring([torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(min(2, len(buckets)))])

    def _reading(self) -> contextlib.AbstractContextManager:
        """Where reads of the trainer's shards run: the side stream on GPU, in line on CPU."""
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def _event(self) -> torch.cuda.Event | None:
        """An event at the current point of the current stream (None on CPU, where the order is the program's)."""
        if self.side is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def pack(self, bucket: Bucket, buf: Tensor) -> Tensor:
        """Fill `buf` with the bucket's pieces and their checksum; returns the bytes to send."""
        for piece in bucket.pieces:
            self.staging.copy(piece_view(buf, piece), self.source.view(piece.hf_name, piece.box))
        n = bucket.nbytes
        buf[n:n + TRAILER_BYTES].view(torch.int64).copy_(checksum(buf[:n]))
        return buf[:n + TRAILER_BYTES]

    def unpack(self, bucket: Bucket, buf: Tensor, sums: Tensor, compare: list | None) -> None:
        """Check a received bucket into `sums` [2, CHECKSUM_WORDS] and load its pieces (verify=full: compare them
        instead)."""
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

    def _pack_next(self, bucket: Bucket, ring: Ring) -> tuple[int, Tensor]:
        """Pack `bucket` into the next free send buffer (on the side stream on GPU); the transfer, posted from the
        current stream, waits for it. Returns the buffer's slot and the bytes to send."""
        slot, buf = ring.acquire(self.side)
        with self._reading():
            wire = self.pack(bucket, buf)
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        return slot, wire

    def run(self, compare: bool = False) -> TransferStats:
        """One pass over the plan (see the module docstring). `compare`: verify=full, nothing is written."""
        plan = self.plan
        send_ring, recv_ring = self._buffers(plan.sends), self._buffers(plan.recvs)
        sums = torch.zeros(len(plan.recvs), 2, CHECKSUM_WORDS, dtype=torch.int64, device=self.device)
        compared: list | None = [] if compare else None
        sends = {b.step: b for b in plan.sends}
        recvs = {b.step: (i, b) for i, b in enumerate(plan.recvs)}
        steps = sorted(sends.keys() | recvs.keys())
        local = _spread(plan.local, len(steps) + 1)
        if self.side is not None:  # the trainer's last update and the rollout's padding zeroing come first
            self.side.wait_stream(torch.cuda.current_stream(self.device))
        in_flight = None
        for step in steps:
            ops, sent, received = [], None, None
            if step in sends:
                sent, wire = self._pack_next(sends[step], send_ring)
                ops.append(dist.P2POp(dist.isend, wire, sends[step].dst, self.group))
            if step in recvs:
                i, bucket = recvs[step]
                # No event: the transfer writing it follows the current stream, where its last unpack ran.
                slot, buf = recv_ring.acquire()
                ops.append(dist.P2POp(dist.irecv, buf[:bucket.nbytes + TRAILER_BYTES], bucket.src, self.group))
                received = (slot, i, bucket)
            works = dist.batch_isend_irecv(ops)
            if in_flight is not None:
                self._finish(*in_flight, send_ring, recv_ring, sums, compared)
            in_flight = (works, sent, received)
            with self._reading():
                self._copy_local(next(local), compared)
        if in_flight is not None:
            self._finish(*in_flight, send_ring, recv_ring, sums, compared)
        with self._reading():
            self._copy_local(next(local), compared)
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        self.staging.staged.clear()
        host_read, self.staging.read_bytes = self.staging.read_bytes, 0
        check_checksums(plan.recvs, sums)
        if compared is not None:
            check_full([name for name, _ in compared], [flag for _, flag in compared], plan.rank)
        return TransferStats(sum(b.nbytes for b in plan.sends), sum(b.nbytes for b in plan.recvs),
                             sum(p.nbytes for p in plan.local), len(plan.sends) + len(plan.recvs),
                             sum(b.numel() for b in send_ring.buffers + recv_ring.buffers), host_read)

    def _finish(self, works: list, sent: int | None, received: tuple[int, int, Bucket] | None, send_ring: Ring,
                recv_ring: Ring, sums: Tensor, compared: list | None) -> None:
        """Wait for a step; free its send buffer, then check and unpack its received bucket and free that buffer."""
        for work in works:
            work.wait()
        if sent is not None:
            send_ring.release(sent, self._event())
        if received is not None:
            slot, i, bucket = received
            self.unpack(bucket, recv_ring.buffers[slot], sums[i], compared)
            recv_ring.release(slot)


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
