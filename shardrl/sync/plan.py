"""The resharding plan: which trainer rank sends which box of which HF tensor to which rollout rank, in which bucket
and at which step. Pure Python (no torch.distributed): every rank of the sync group computes the same plan from the
same metadata (`Slice`s: what each trainer rank holds and each rollout rank needs), once.

* Sources: each needed box is cut along the trainer's shard boundaries; every piece comes from a trainer rank that
  holds it (its own shard when the rollout rank holds it too: a local copy), chosen among the replicas (DP, EDP,
  KV-head copies) by the fewest bytes sent so far, so replicas split the sending work and no rank funnels it.
* Buckets: the pieces of one (sender, receiver) pair packed back to back (16-byte aligned), pieces larger than a
  bucket cut along their outer dims. A rank that both sends and receives (colocated) double-buffers both ways, so
  its buckets are half the size: either way its buffers total two buckets.
* Steps: buckets are scheduled so that in every step each rank sends at most one bucket and receives at most one
  (a greedy edge colouring of the sender/receiver multigraph); a pair's buckets keep their order.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

Box = tuple[tuple[int, int], ...]  # [start, stop) along every dim of the full HF tensor
ALIGN = 16  # bytes: every piece starts aligned, so a bucket is a whole number of int64 words
# The checksum (verify.checksum): one int64 per block of this many bytes of a bucket, following its data on the wire.
CHECKSUM_BLOCK_BYTES = 4096


def trailer_bytes(nbytes: int) -> int:
    """Bytes of the checksum of a bucket of `nbytes` data bytes: 8 per (started) checksum block."""
    return 8 * -(-nbytes // CHECKSUM_BLOCK_BYTES)


class PlanError(ValueError):
    """The trainer's and the rollout's parameters do not fit together; the message names the tensor and ranks."""


@dataclass(frozen=True)
class Slice:
    """A box of one HF tensor that a rank holds (trainer) or needs (rollout), in that rank's parameter dtype.

    Expert params are one slice per parameter, not per expert: `hf_name` is the spec's template (with `{expert}`),
    `full_shape` one expert's shape, and the box has a leading dim of global expert ids. Runs of experts then move
    as single pieces (one copy each way), whatever the number of experts."""

    hf_name: str
    full_shape: tuple[int, ...]
    box: Box
    dtype: torch.dtype
    expert: bool = False


@dataclass(frozen=True)
class Piece:
    """A box moved as one contiguous run of `dtype` (the receiver's dtype) at byte `offset` of its bucket."""

    hf_name: str
    box: Box
    dtype: torch.dtype
    expert: bool = False
    offset: int = 0

    @property
    def name(self) -> str:
        """For messages: the HF name, experts written as their id range (`...experts.4-7.down_proj.weight`)."""
        if not self.expert:
            return self.hf_name
        first, stop = self.box[0]
        return self.hf_name.format(expert=first if stop == first + 1 else f"{first}-{stop - 1}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)

    @property
    def nbytes(self) -> int:
        return volume(self.box) * self.dtype.itemsize


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    piece: Piece


@dataclass(frozen=True)
class Bucket:
    src: int
    dst: int
    step: int
    pieces: tuple[Piece, ...]
    nbytes: int  # data bytes (a multiple of ALIGN); the checksum trailer follows

    def names(self) -> list[str]:
        return list(dict.fromkeys(p.name for p in self.pieces))

    @property
    def wire_bytes(self) -> int:
        """Data and checksum trailer: what travels."""
        return self.nbytes + trailer_bytes(self.nbytes)

    @cached_property
    def identity(self) -> int:
        """A 63-bit fingerprint of the bucket's place in the plan (pair, step, size, every piece's tensor, box and
        offset), the same on sender and receiver: its checksum covers it, so a buffer holding another bucket
        (with that bucket's valid trailer) fails."""
        text = repr((self.src, self.dst, self.step, self.nbytes,
                     [(p.hf_name, p.box, p.offset, str(p.dtype)) for p in self.pieces]))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

    def names_in(self, start: int, stop: int) -> list[str]:
        """The tensors whose pieces overlap data bytes [start, stop)."""
        return list(dict.fromkeys(p.name for p in self.pieces if p.offset < stop and start < p.offset + p.nbytes))


@dataclass
class RankPlan:
    """One rank's share of the plan: buckets to send and receive (in step order) and pieces to copy locally."""

    rank: int
    sends: list[Bucket] = field(default_factory=list)
    recvs: list[Bucket] = field(default_factory=list)
    local: list[Piece] = field(default_factory=list)


@dataclass
class SyncPlan:
    buckets: list[Bucket]
    local: list[Transfer]
    bucket_bytes: int

    def for_rank(self, rank: int) -> RankPlan:
        return RankPlan(rank, [b for b in self.buckets if b.src == rank], [b for b in self.buckets if b.dst == rank],
                        [t.piece for t in self.local if t.dst == rank])

    @property
    def num_steps(self) -> int:
        return 1 + max((b.step for b in self.buckets), default=-1)


def volume(box: Box) -> int:
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


def intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(start < stop for start, stop in box) else None


def plan_transfers(holdings: Mapping[int, Sequence[Slice]], needs: Mapping[int, Sequence[Slice]],
                   bucket_bytes: int) -> SyncPlan:
    """The whole plan from every trainer rank's holdings and every rollout rank's needs (global ranks)."""
    transfers = assign_sources(holdings, needs)
    remote = [t for t in transfers if t.src != t.dst]
    both = {t.src for t in remote} & {t.dst for t in remote}
    per_rank = {r: bucket_bytes // 2 if r in both else bucket_bytes for t in remote for r in (t.src, t.dst)}
    buckets = pack_buckets(remote, lambda src, dst: min(per_rank[src], per_rank[dst]))
    return SyncPlan(schedule(buckets), [t for t in transfers if t.src == t.dst], bucket_bytes)


def _index_holdings(holdings: Mapping[int, Sequence[Slice]]) -> dict[str, tuple[tuple[int, ...], dict[Box, list]]]:
    """hf_name -> (full shape, {box: ranks holding it}); distinct boxes of one tensor must not overlap."""
    index: dict[str, tuple[tuple[int, ...], dict[Box, list[int]]]] = {}
    for rank in sorted(holdings):
        for s in holdings[rank]:
            shape, boxes = index.setdefault(s.hf_name, (s.full_shape, {}))
            if shape != s.full_shape:
                raise PlanError(f"{s.hf_name}: trainer ranks disagree on its shape ({shape} vs {s.full_shape})")
            if s.box not in boxes and any(intersect(s.box, other) for other in boxes):
                raise PlanError(f"{s.hf_name}: trainer rank {rank} holds {s.box}, overlapping {list(boxes)}")
            boxes.setdefault(s.box, []).append(rank)
    return index


def assign_sources(holdings: Mapping[int, Sequence[Slice]], needs: Mapping[int, Sequence[Slice]]) -> list[Transfer]:
    """Cut every needed box along the trainer's shards and pick a sender for each piece (see the module doc)."""
    index = _index_holdings(holdings)
    sent: Counter[int] = Counter()
    transfers = []
    for dst in sorted(needs):
        for need in needs[dst]:
            if need.hf_name not in index:
                raise PlanError(f"{need.hf_name}: rollout rank {dst} needs it but no trainer rank holds it")
            shape, boxes = index[need.hf_name]
            if shape != need.full_shape:
                raise PlanError(f"{need.hf_name}: trainer shape {shape} != rollout shape {need.full_shape}")
            covered = 0
            for box, ranks in boxes.items():
                part = intersect(box, need.box)
                if part is None:
                    continue
                src = dst if dst in ranks else min(ranks, key=lambda r: (sent[r], r))
                piece = Piece(need.hf_name, part, need.dtype, need.expert)
                sent[src] += piece.nbytes if src != dst else 0
                transfers.append(Transfer(src, dst, piece))
                covered += volume(part)
            if covered != volume(need.box):
                raise PlanError(f"{need.hf_name}: rollout rank {dst} needs {need.box} but the trainer ranks hold "
                                f"only {list(boxes)}")
    needed = {s.hf_name for ranks in needs.values() for s in ranks}
    if extra := sorted(set(index) - needed):
        raise PlanError(f"the trainer holds tensors the rollout model lacks: {extra[:5]} (same model on both sides?)")
    return transfers


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def split_piece(piece: Piece, max_bytes: int) -> list[Piece]:
    """`piece` as pieces of at most `max_bytes`: cut along the outermost dim whose inner block still fits."""
    if piece.nbytes <= max_bytes:
        return [piece]
    shape, inner = piece.shape, piece.dtype.itemsize
    inner_bytes = []  # bytes of one index step along each dim
    for size in reversed(shape):
        inner_bytes.insert(0, inner)
        inner *= size
    dim = next((d for d, b in enumerate(inner_bytes) if b <= max_bytes), None)
    if dim is None:
        raise PlanError(f"{piece.name}: bucket of {max_bytes} bytes cannot hold one element")
    step = max_bytes // inner_bytes[dim]
    outer = [range(start, stop) for start, stop in piece.box[:dim]]
    start, stop = piece.box[dim]
    pieces = []
    for index in itertools.product(*outer):
        for lo in range(start, stop, step):
            box = (*((i, i + 1) for i in index), (lo, min(lo + step, stop)), *piece.box[dim + 1:])
            pieces.append(replace(piece, box=box))
    return pieces


def pack_buckets(transfers: Sequence[Transfer], buffer_bytes) -> list[Bucket]:
    """Pack each (src, dst) pair's pieces into buckets whose data and checksum trailer fit `buffer_bytes(src, dst)`
    (the checksum needs no scratch worth counting). Steps are left at -1 for `schedule`."""

    def capacity_of(size: int) -> int:  # the most data bytes (aligned) whose trailer fits beside them
        capacity = (size * CHECKSUM_BLOCK_BYTES // (CHECKSUM_BLOCK_BYTES + 8)) // ALIGN * ALIGN
        while capacity > 0 and capacity + trailer_bytes(capacity) > size:
            capacity -= ALIGN
        return capacity

    pairs: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for t in transfers:
        pairs[t.src, t.dst].append(t.piece)
    buckets = []
    for (src, dst), pieces in pairs.items():
        size = buffer_bytes(src, dst)
        capacity = capacity_of(size)
        current: list[Piece] = []
        offset = 0
        for part in (p for piece in pieces for p in split_piece(piece, capacity)):
            if current and offset + _align(part.nbytes) > capacity:
                buckets.append(Bucket(src, dst, -1, tuple(current), offset))
                current, offset = [], 0
            current.append(replace(part, offset=offset))
            offset += _align(part.nbytes)
        if current:
            buckets.append(Bucket(src, dst, -1, tuple(current), offset))
    return buckets


def schedule(buckets: Sequence[Bucket]) -> list[Bucket]:
    """Give every bucket a step: each rank sends <= 1 and receives <= 1 bucket per step, a pair's buckets in order.

    Each sender cycles through its receivers starting at a shift given by its position (sender i begins with its
    i-th receiver), so uniform all-to-all traffic lands in a conflict-free rotation; a greedy earliest-free-step
    assignment handles the rest."""
    by_pair: dict[tuple[int, int], list[Bucket]] = defaultdict(list)
    for b in buckets:
        by_pair[b.src, b.dst].append(b)
    queues = []
    for i, src in enumerate(sorted({src for src, _ in by_pair})):
        dsts = sorted(dst for s, dst in by_pair if s == src)
        dsts = dsts[i % len(dsts):] + dsts[:i % len(dsts)]
        queues.append([b for round_ in itertools.zip_longest(*(by_pair[src, d] for d in dsts)) for b in round_
                       if b is not None])
    sending: dict[int, set[int]] = defaultdict(set)
    receiving: dict[int, set[int]] = defaultdict(set)
    next_step: Counter[tuple[int, int]] = Counter()
    out = []
    for b in (b for round_ in itertools.zip_longest(*queues) for b in round_ if b is not None):
        step = next_step[b.src, b.dst]
        while step in sending[b.src] or step in receiving[b.dst]:
            step += 1
        sending[b.src].add(step)
        receiving[b.dst].add(step)
        next_step[b.src, b.dst] = step + 1
        out.append(replace(b, step=step))
    return sorted(out, key=lambda b: (b.step, b.src, b.dst))
