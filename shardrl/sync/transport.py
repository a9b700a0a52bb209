"""Execute one rank's share of a `SyncPlan`: local copies, and buckets sent and received over the sync group.

Double-buffered pipeline, one iteration per step this rank takes part in:
    pack bucket i into the next free send buffer (trainer shards -> bucket, from the device or pinned host memory)
        and append its checksum
    post step i (isend / irecv, batched so no pair can deadlock)
    finish step i-1: wait, free its send buffer, checksum the received bucket, copy its pieces into the rollout
        shards, free its receive buffer
    a share of the local (same-rank) copies
so packing, the transfer in flight and unpacking overlap. Every transfer finishes before the sync's deadline or the
run fails naming its peer (`watch.SyncWatch`). On GPU everything that reads the trainer's shards
(packing, local copies: device copies or pinned host -> device DMA) runs on a side stream, the transfer on NCCL's
stream and the unpacking on the current stream, so PCIe, NVLink and HBM work at once; CUDA events order them. With
gloo the transfer runs in gloo's background threads against this thread. Each direction has two buffers handed out
in turn (`Ring`); a buffer is written again only after the step that used it finished (and, on GPU, the writing
stream waits for the event marking that). Peak extra memory: the buffers (a bucket each, half a bucket each for a
rank that both sends and receives) and, for offloaded params read in strided or converted pieces, staged params up
to the size of the largest one (`HostStaging`).

The copies of a bucket or of a share of local copies go out as one `CopyBatch` (a few launches, not one per piece).
An offloaded param that is staged is read from host memory once per sync: its local pieces are copied right after
its first piece is packed, while its staged copy is still there (`_place_local`). A share of local copies between
device-resident params is the same set of copies every sync, so it is replayed (`CopyReplay`) for as long as every
param involved stays where it was, which is checked each sync: on GPU as one CUDA graph, on CPU from its kept views.
Cutting ~430 views out of a 3B model's params and launching a copy per big piece took longer than the copies
themselves on an H200.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from shardrl.errors import first_line
from shardrl.sync.copies import CopyBatch, CopyReplay, HostStaging
from shardrl.sync.plan import Bucket, Piece, RankPlan, trailer_bytes
from shardrl.sync.shards import Shards
from shardrl.sync.verify import check_checksums, check_full, checksum
from shardrl.sync.watch import SyncStalledError, SyncWatch, Transfer, step_transfers


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    buckets: int = 0
    buffer_bytes: int = 0
    host_read_bytes: int = 0  # crossed from pinned host memory (offloaded params), staged params counted whole
    copy_launches: int = 0  # copy calls this rank issued (a multi-tensor copy counts once): the host's share of work


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
                 source: Shards | None, target: Shards | None, watch: SyncWatch, peers: Mapping[int, str]) -> None:
        """`watch`: the deadline every transfer of a run must meet; `peers`: each global rank of the group as a
        `SyncStalledError` names it."""
        self.plan, self.group, self.device = plan, group, device
        self.source, self.target = source, target
        self.watch, self.peers = watch, peers
        self.staged_names = self._staged_names()
        # Staging for offloaded params: the largest param's bytes (the "+ largest tensor" of the memory bound). When
        # smaller params are staged it holds several, so a param sent to several ranks in consecutive steps is
        # often still there for the next one.
        self.staging = HostStaging(device, source.largest_bytes() if source else 0)
        # Made once: the allocator keeps the side stream's blocks (staged params) for reuse by later syncs.
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.kept_with, self.kept_apart = self._place_local()
        # Per share of `kept_apart` (by its index in the run): where its params were (`_addresses`) and its replay
        # (on GPU None until it is recorded as a graph).
        self.replays: dict[int, tuple[tuple[int, ...], CopyReplay | None]] = {}
        # Runs so far, on this rank: every rank of the group runs the same ones, so a bucket's checksum can cover
        # its sync's number and a bucket left over from an earlier run fails.
        self.version = 0
        self.launches = 0  # copy calls issued during the current run

    def _staged_names(self) -> set[str]:
        """Params this rank stages whole when offloaded: it reads some piece of them that is not a contiguous run
        of the wire dtype (the host copy is laid out like the param, so its views are strided alike)."""
        pieces = [p for b in self.plan.sends for p in b.pieces] + list(self.plan.local)
        return {p.hf_name for p in pieces
                if not ((view := self.source.view(p.hf_name, p.box)).is_contiguous() and view.dtype == p.dtype)}

    def _place_local(self) -> tuple[dict[tuple[int, int], list[Piece]], list[Piece]]:
        """Local pieces of a staged param that is also sent are copied right after its first piece is packed
        (keyed by (step, index of that piece in its bucket)), while its staged copy is still there, so it is read
        from host memory once; the other local pieces are spread over the steps."""
        by_name: dict[str, list[Piece]] = {}
        for piece in self.plan.local:
            by_name.setdefault(piece.hf_name, []).append(piece)
        kept_with: dict[tuple[int, int], list[Piece]] = {}
        for bucket in self.plan.sends:
            for i, piece in enumerate(bucket.pieces):
                if piece.hf_name in self.staged_names and piece.hf_name in by_name:
                    kept_with[bucket.step, i] = by_name.pop(piece.hf_name)
        return kept_with, [p for p in self.plan.local if p.hf_name in by_name]

    def _buffers(self, buckets: Sequence[Bucket]) -> Ring:
        if not buckets:
            return Ring([])
        size = max(b.wire_bytes for b in buckets)
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

    def _read(self, piece: Piece, batch: CopyBatch) -> Tensor:
        """The source of `piece`: a device view, or for an offloaded param its host run (DMA'd straight into the
        destination) or a view of its staged device copy (the batch is flushed before a new param is staged, so
        no pending copy holds a staged param the staging evicts)."""
        src = self.source.view(piece.hf_name, piece.box)
        if not self.source.offloaded(piece.hf_name):
            return src
        if piece.hf_name not in self.staged_names:
            return self.staging.direct(src)
        if not self.staging.has(src):
            batch.flush()
            self.launches += 1  # the staging copy
        return self.staging.view(src)

    def _flush(self, batch: CopyBatch) -> None:
        batch.flush()
        self.launches += batch.launches

    def _keep(self, piece: Piece, batch: CopyBatch, compare: list | None) -> None:
        """A local piece: copied in place (verify=full: compared with its source instead)."""
        dst = self.target.view(piece.hf_name, piece.box)
        if compare is None:
            batch.add(dst, self._read(piece, batch))
        else:
            src = self.source.view(piece.hf_name, piece.box)
            compare.append((piece.name, (dst != src.to(dst.device, dst.dtype)).any()))

    def pack(self, bucket: Bucket, buf: Tensor, compare: list | None = None) -> Tensor:
        """Fill `buf` with the bucket's pieces and their checksum, and copy the local pieces placed with them;
        returns the bytes to send."""
        batch = CopyBatch()
        for i, piece in enumerate(bucket.pieces):
            batch.add(piece_view(buf, piece), self._read(piece, batch))
            for kept in self.kept_with.get((bucket.step, i), ()):
                self._keep(kept, batch, compare)
        self._flush(batch)
        n = bucket.nbytes
        buf[n:bucket.wire_bytes].view(torch.int64).copy_(checksum(buf[:n], bucket.identity, self.version))
        return buf[:bucket.wire_bytes]

    def unpack(self, bucket: Bucket, buf: Tensor, sums: Tensor, compare: list | None) -> None:
        """Check a received bucket into `sums` [2, blocks] (the sender's checksum, then this rank's of what
        arrived, for this bucket of this run) and load its pieces (verify=full: compare them instead)."""
        n = bucket.nbytes
        sums[0] = buf[n:bucket.wire_bytes].view(torch.int64)
        sums[1] = checksum(buf[:n], bucket.identity, self.version)
        batch = CopyBatch()
        for piece in bucket.pieces:
            dst = self.target.view(piece.hf_name, piece.box)
            if compare is None:
                batch.add(dst, piece_view(buf, piece))
            else:
                compare.append((piece.name, (dst != piece_view(buf, piece)).any()))
        self._flush(batch)

    def _copy_local(self, share: int, pieces: Sequence[Piece], compare: list | None) -> None:
        """Share `share` of the local pieces kept apart: replayed when every param it reads and writes is where it
        was when the replay was made (none offloaded), else cut anew. On GPU the replay is a CUDA graph, recorded
        by the first sync that finds the share unchanged; it holds no tensor, so sleeping engines free their weights."""
        where = self._addresses(pieces) if compare is None else None
        cached = self.replays.get(share)
        if where is not None and cached is not None and cached[0] == where:
            replay = cached[1]
            if replay is None:  # GPU, unchanged since the last sync: record it (the side stream is current here)
                replay = self._cut(pieces, None).replay()
                replay.record()
                self.replays[share] = (where, replay)
            self.launches += replay.issue()
            return
        batch = self._cut(pieces, compare)
        replay = batch.flush()
        self.launches += batch.launches
        if where is None:
            self.replays.pop(share, None)
        else:  # on GPU only the addresses: views kept past the sync would keep a sleeping engine's weights alive
            self.replays[share] = (where, None if self.side is not None else replay)

    def _cut(self, pieces: Sequence[Piece], compare: list | None) -> CopyBatch:
        batch = CopyBatch()
        for piece in pieces:
            self._keep(piece, batch, compare)
        return batch

    def _addresses(self, pieces: Sequence[Piece]) -> tuple[int, ...] | None:
        """Where the params `pieces` read and write lie, or None when one is offloaded.

        On GPU, each param's data address: a graph copies between raw addresses at fixed offsets from them (a
        param's shape and layout come from its spec), so it stays right for a param given new `.data` at the same
        address and any move changes the key. On CPU the replay holds views, so also each storage's identity (its
        C++ object's address, which no other storage can take while the views hold it): a view of a replaced
        storage would copy from or into memory the param no longer uses."""
        out = []
        for piece in pieces:
            for shards in (self.source, self.target):
                param = shards.params[piece.hf_name]
                storage = param.untyped_storage()
                if storage.nbytes() == 0:
                    return None
                out.append(param.data_ptr())
                if self.side is None:
                    out.append(storage._cdata)
        return tuple(out)

    def _pack_next(self, bucket: Bucket, ring: Ring, compare: list | None) -> tuple[int, Tensor]:
        """Pack `bucket` into the next free send buffer (on the side stream on GPU); the transfer, posted from the
        current stream, waits for it. Returns the buffer's slot and the bytes to send."""
        slot, buf = ring.acquire(self.side)
        with self._reading():
            wire = self.pack(bucket, buf, compare)
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        return slot, wire

    def run(self, compare: bool = False) -> TransferStats:
        """One pass over the plan (see the module docstring). `compare`: verify=full, nothing is written."""
        plan = self.plan
        send_ring, recv_ring = self._buffers(plan.sends), self._buffers(plan.recvs)
        self.version += 1
        blocks = [trailer_bytes(b.nbytes) // 8 for b in plan.recvs]
        sums = torch.zeros(2, sum(blocks), dtype=torch.int64, device=self.device).split(blocks, dim=1)
        compared: list | None = [] if compare else None
        sends = {b.step: b for b in plan.sends}
        recvs = {b.step: (i, b) for i, b in enumerate(plan.recvs)}
        steps = sorted(sends.keys() | recvs.keys())
        local = enumerate(_spread(self.kept_apart, len(steps) + 1))
        self.launches = 0
        if self.side is not None:  # the trainer's last update and the rollout's padding zeroing come first
            self.side.wait_stream(torch.cuda.current_stream(self.device))
        in_flight = None
        self.watch.start()
        for step in steps:
            ops, sent, received = [], None, None
            if step in sends:
                sent, wire = self._pack_next(sends[step], send_ring, compared)
                ops.append(dist.P2POp(dist.isend, wire, sends[step].dst, self.group))
            if step in recvs:
                i, bucket = recvs[step]
                # No event: the transfer writing it follows the current stream, where its last unpack ran.
                slot, buf = recv_ring.acquire()
                ops.append(dist.P2POp(dist.irecv, buf[:bucket.wire_bytes], bucket.src, self.group))
                received = (slot, i, bucket)
            transfers = step_transfers(self._post(step, ops), ops, self.peers, step)
            if in_flight is not None:
                self._finish(*in_flight, send_ring, recv_ring, sums, compared)
            in_flight = (transfers, sent, received)
            with self._reading():
                self._copy_local(*next(local), compared)
        if in_flight is not None:
            self._finish(*in_flight, send_ring, recv_ring, sums, compared)
        with self._reading():
            self._copy_local(*next(local), compared)
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        self.watch.drain()
        self.staging.clear()
        host_read, self.staging.read_bytes = self.staging.read_bytes, 0
        check_checksums(plan.recvs, [s[0] for s in sums], [s[1] for s in sums])
        if compared is not None:
            check_full([name for name, _ in compared], [flag for _, flag in compared], plan.rank)
        return TransferStats(sum(b.nbytes for b in plan.sends), sum(b.nbytes for b in plan.recvs),
                             sum(p.nbytes for p in plan.local), len(plan.sends) + len(plan.recvs),
                             sum(b.numel() for b in send_ring.buffers + recv_ring.buffers), host_read, self.launches)

    def _post(self, step: int, ops: list[dist.P2POp]) -> list[dist.Work]:
        """Start a step's transfers (gloo may already fail here, on a peer that is gone)."""
        try:
            return dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            peers = ", ".join(self.peers[op.peer] for op in ops)
            raise SyncStalledError(f"weight sync step {step}: starting the transfers with {peers} failed: "
                                   f"{first_line(exc)}") from exc

    def _finish(self, transfers: list[Transfer], sent: int | None, received: tuple[int, int, Bucket] | None,
                send_ring: Ring, recv_ring: Ring, sums: Sequence[Tensor], compared: list | None) -> None:
        """Wait for a step (within the sync's deadline); free its send buffer, then check and unpack its received
        bucket and free that buffer."""
        self.watch.finish(transfers)
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
