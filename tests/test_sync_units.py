"""Weight-sync units without processes: the resharding plan by hand (sources, buckets, steps, errors), the
bucket checksum against a pure-Python reference (and that it catches a flipped bit anywhere, words trading places,
another bucket's or another sync's valid trailer, and names the damaged tensor), the buffer ring's rotation (no
buffer reused while in flight), batched copies and host staging."""

import struct

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from shardrl.parallel.spec import ShardSpec
from shardrl.sync.plan import (
    ALIGN,
    CHECKSUM_BLOCK_BYTES,
    Bucket,
    Piece,
    PlanError,
    Slice,
    Transfer,
    assign_sources,
    pack_buckets,
    plan_transfers,
    schedule,
    split_piece,
    trailer_bytes,
)
from shardrl.sync.shards import shard_box
from shardrl.sync.copies import MEMCPY_MIN_BYTES, CopyBatch, HostStaging
from shardrl.sync.transport import BufferInFlightError, Ring
from shardrl.sync.verify import SyncVerifyError, check_checksums, checksum

F32 = torch.float32


def rows(start, stop, cols=6):
    return ((start, stop), (0, cols))


def test_tp2_dp2_trainer_to_two_rollout_replicas_split_by_columns():
    # w [4, 6]: trainer TP2 splits rows (ranks 0,1; DP replicas 2,3); rollout TP2 splits columns, two replicas
    # (ranks 4,5 and 6,7). Each rollout rank needs both trainer row blocks of its columns.
    holdings = {0: [Slice("w", (4, 6), rows(0, 2), F32)], 1: [Slice("w", (4, 6), rows(2, 4), F32)],
                2: [Slice("w", (4, 6), rows(0, 2), F32)], 3: [Slice("w", (4, 6), rows(2, 4), F32)]}
    cols = {4: (0, 3), 5: (3, 6), 6: (0, 3), 7: (3, 6)}
    needs = {r: [Slice("w", (4, 6), ((0, 4), c), F32)] for r, c in cols.items()}
    got = [(t.src, t.dst, t.piece.box) for t in assign_sources(holdings, needs)]
    # Fewest bytes sent so far, ties to the lower rank: the DP replicas alternate.
    assert got == [
        (0, 4, ((0, 2), (0, 3))), (1, 4, ((2, 4), (0, 3))),
        (2, 5, ((0, 2), (3, 6))), (3, 5, ((2, 4), (3, 6))),
        (0, 6, ((0, 2), (0, 3))), (1, 6, ((2, 4), (0, 3))),
        (2, 7, ((0, 2), (3, 6))), (3, 7, ((2, 4), (3, 6))),
    ]


def test_colocated_rank_copies_what_it_holds():
    holdings = {0: [Slice("w", (4, 6), rows(0, 2), F32)], 1: [Slice("w", (4, 6), rows(2, 4), F32)]}
    needs = {0: [Slice("w", (4, 6), rows(0, 4), torch.bfloat16)], 1: [Slice("w", (4, 6), rows(0, 4), torch.bfloat16)]}
    plan = plan_transfers(holdings, needs, bucket_bytes=1024)
    assert [(t.src, t.dst, t.piece.box) for t in plan.local] == [(0, 0, rows(0, 2)), (1, 1, rows(2, 4))]
    assert [(b.src, b.dst, b.step, [p.box for p in b.pieces]) for b in plan.buckets] == [
        (0, 1, 0, [rows(0, 2)]), (1, 0, 0, [rows(2, 4)])]
    assert plan.buckets[0].pieces[0].dtype == torch.bfloat16  # the wire carries the receiver's dtype


def test_shard_boxes_follow_the_spec_padding_and_experts():
    vocab = ShardSpec("embed", (10, 4), dim=0, num_shards=4, index=3, padded_dim_size=12)
    assert shard_box(vocab) == ((9, 10), (0, 4))  # last shard: 1 real row, 2 padding rows
    assert shard_box(ShardSpec("embed", (9, 4), dim=0, num_shards=4, index=3, padded_dim_size=12)) is None
    down = ShardSpec("e.{expert}.down", (4, 8), dim=1, num_shards=2, index=1, group="etp", expert_ids=(2, 3))
    assert shard_box(down) == ((2, 4), (0, 4), (4, 8))  # experts 2-3, then the tensor's own dims


def test_split_piece_cuts_outer_dims_first():
    piece = Piece("w", ((0, 4), (0, 6)), F32)  # 96 bytes, rows of 24
    assert [p.box for p in split_piece(piece, 50)] == [((0, 2), (0, 6)), ((2, 4), (0, 6))]
    assert [p.box for p in split_piece(piece, 20)] == [((r, r + 1), (c, min(c + 5, 6))) for r in range(4)
                                                       for c in (0, 5)]
    assert split_piece(piece, 96) == [piece]


def test_buckets_respect_capacity_alignment_and_order():
    pieces = [Piece(f"t{i}", ((0, n),), F32) for i, n in enumerate([3, 10, 40, 5])]  # 12, 40, 160, 20 bytes
    buckets = pack_buckets([Transfer(0, 1, p) for p in pieces], lambda src, dst: 96 + trailer_bytes(96))
    capacity = 96
    assert all(b.nbytes <= capacity and all(p.offset % ALIGN == 0 for p in b.pieces) for b in buckets)
    layout = [[(p.hf_name, p.box, p.offset) for p in b.pieces] for b in buckets]
    assert layout == [[("t0", ((0, 3),), 0), ("t1", ((0, 10),), 16)],
                      [("t2", ((0, 24),), 0)], [("t2", ((24, 40),), 0), ("t3", ((0, 5),), 64)]]


def test_schedule_each_rank_sends_and_receives_one_bucket_per_step():
    pieces = [Piece("w", ((i, i + 1),), F32) for i in range(3)]
    buckets = pack_buckets([Transfer(s, d, p) for s in range(3) for d in range(3, 6)
                            for p in pieces], lambda src, dst: 16 + trailer_bytes(16))  # a piece per bucket
    steps = schedule(buckets)
    assert len(steps) == len(buckets) == 27
    for step in {b.step for b in steps}:
        at = [b for b in steps if b.step == step]
        assert len({b.src for b in at}) == len(at) and len({b.dst for b in at}) == len(at)
    for src, dst in {(b.src, b.dst) for b in steps}:
        pair = [b for b in steps if (b.src, b.dst) == (src, dst)]
        assert [b.pieces[0].box for b in pair] == [p.box for p in pieces]  # a pair's buckets keep their order
    assert max(b.step for b in steps) + 1 == 9  # 9 buckets per sender: the greedy colouring is optimal here


def test_colocated_ranks_halve_their_buckets():
    # Both ranks send and receive: two send plus two receive buffers of half a bucket each.
    holdings = {0: [Slice("w", (64, 16), ((0, 32), (0, 16)), F32)], 1: [Slice("w", (64, 16), ((32, 64), (0, 16)), F32)]}
    needs = {r: [Slice("w", (64, 16), ((0, 64), (0, 16)), F32)] for r in (0, 1)}
    plan = plan_transfers(holdings, needs, bucket_bytes=1024)
    assert max(b.wire_bytes for b in plan.buckets) <= 512
    assert sum(b.nbytes for b in plan.buckets if b.src == 0) == 32 * 16 * 4


@pytest.mark.parametrize("holdings, needs, message", [
    ({0: [Slice("w", (4,), ((0, 2),), F32)]}, {1: [Slice("w", (4,), ((0, 4),), F32)]}, "hold only"),
    ({0: [Slice("w", (4,), ((0, 4),), F32)]}, {1: [Slice("w", (5,), ((0, 5),), F32)]}, "shape"),
    ({0: [Slice("w", (4,), ((0, 4),), F32)]}, {1: [Slice("v", (4,), ((0, 4),), F32)]}, "no trainer rank"),
    ({0: [Slice("w", (4,), ((0, 4),), F32), Slice("b", (4,), ((0, 4),), F32)]},
     {1: [Slice("w", (4,), ((0, 4),), F32)]}, "rollout model lacks"),
    ({0: [Slice("w", (4,), ((0, 3),), F32)], 1: [Slice("w", (4,), ((2, 4),), F32)]},
     {2: [Slice("w", (4,), ((0, 4),), F32)]}, "overlapping"),
])
def test_plan_errors_name_the_tensor(holdings, needs, message):
    with pytest.raises(PlanError, match=message):
        plan_transfers(holdings, needs, bucket_bytes=1024)


MASK = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15


def _splitmix(x: int) -> int:
    """SplitMix64's finaliser on unsigned 64-bit Python ints."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def _reference_checksum(data: bytes, identity: int = 0, version: int = 0) -> list[int]:
    """verify.checksum in plain Python: per block of CHECKSUM_BLOCK_BYTES, the sum of its little-endian words times
    an odd multiplier of their position (splitmix of (position + 1) * golden, low bit set), plus the salt splitmix of
    (block * golden + seed), seed from the bucket's identity and the version; all modulo 2**64, as signed int64."""
    words = struct.unpack(f"<{len(data) // 8}Q", data)
    per_block = CHECKSUM_BLOCK_BYTES // 8
    mult = [_splitmix(((j + 1) * GOLDEN) & MASK) | 1 for j in range(per_block)]
    seed = (identity * 0x100000001B3 + version * 0xC2B2AE3D27D4EB4F) & MASK
    out = []
    for block in range(-(-len(words) // per_block)):
        chunk = words[block * per_block:(block + 1) * per_block]
        total = sum(w * m for w, m in zip(chunk, mult)) + _splitmix((block * GOLDEN + seed) & MASK)
        total &= MASK
        out.append(total - 2**64 if total >= 2**63 else total)
    return out


def _random_bytes(num_bytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("num_bytes", [8, 24, 13 * 8, 1000 * 8, 4099 * 8])
def test_checksum_matches_python(num_bytes):
    data = _random_bytes(num_bytes)
    assert checksum(data).tolist() == _reference_checksum(bytes(data.tolist()))
    assert checksum(data, 12345, 7).tolist() == _reference_checksum(bytes(data.tolist()), 12345, 7)


@pytest.mark.parametrize("num_bytes", [8, 13 * 8, CHECKSUM_BLOCK_BYTES + 16])
def test_checksum_catches_a_flipped_bit_in_every_byte(num_bytes):
    # Every byte, so the first and last element, the block boundary and the ragged tail are all covered.
    data = _random_bytes(num_bytes)
    reference = checksum(data)
    for position in range(0, num_bytes, 1 if num_bytes < 1024 else 61):
        for bit in (0, 7):
            flipped = data.clone()
            flipped[position] ^= 1 << bit
            assert not torch.equal(checksum(flipped), reference), (position, bit)


def test_checksum_catches_a_wrapped_top_bit_and_words_that_trade_places():
    words = torch.arange(1, 3 * CHECKSUM_BLOCK_BYTES // 8 + 1, dtype=torch.int64)  # three blocks
    reference = checksum(words.view(torch.uint8))
    top = words.clone()
    top[-1] ^= -2**63  # the sign bit: the block's sum moves by 2**63 times an odd number, not 0 modulo 2**64
    assert not torch.equal(checksum(top.view(torch.uint8)), reference)
    per_block = CHECKSUM_BLOCK_BYTES // 8
    for i, j in ((0, 1), (5, per_block - 1), (0, per_block), (3, 2 * per_block + 3)):  # within and across blocks
        swapped = words.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert not torch.equal(checksum(swapped.view(torch.uint8)), reference), (i, j)
    rotated = words.view(3, per_block).roll(1, dims=0).flatten()  # whole blocks moved: each keeps its own sum
    assert not torch.equal(checksum(rotated.view(torch.uint8)), reference)


def _bucket(step: int, sizes: list[int]) -> Bucket:
    """A bucket of float32 tensors t0, t1, ... of `sizes` elements, packed as pack_buckets does."""
    pieces, offset = [], 0
    for i, n in enumerate(sizes):
        pieces.append(Piece(f"t{i}", ((0, n),), F32, offset=offset))
        offset += -(-n * 4 // ALIGN) * ALIGN
    return Bucket(0, 1, step, tuple(pieces), offset)


def _check(bucket: Bucket, wire: torch.Tensor, version: int) -> None:
    """The receiver's side: the trailer that came with `wire` against its own checksum of the data."""
    n = bucket.nbytes
    sent = wire[n:bucket.wire_bytes].view(torch.int64)
    check_checksums([bucket], [sent], [checksum(wire[:n], bucket.identity, version)])


def _wire(bucket: Bucket, data: torch.Tensor, version: int) -> torch.Tensor:
    """The sender's side: data and its trailer."""
    return torch.cat([data, checksum(data, bucket.identity, version).view(torch.uint8)])


def test_the_default_check_catches_every_injected_fault_and_names_the_damaged_tensor():
    sizes = [5000, 300, 2048, 7]  # t0 spans blocks 0-4, t1 block 4-5, t2 blocks 5-7, t3 block 7
    bucket, other = _bucket(3, sizes), _bucket(4, sizes)  # the same layout one step later
    data = _random_bytes(bucket.nbytes)
    wire = _wire(bucket, data, version=2)
    _check(bucket, wire, version=2)  # intact: passes

    def damaged(wire: torch.Tensor, version: int = 2) -> str:
        with pytest.raises(SyncVerifyError) as error:
            _check(bucket, wire, version)
        return str(error.value)

    t2 = bucket.pieces[2].offset
    flipped = wire.clone()
    flipped[t2 + 100] ^= 0x04
    message = damaged(flipped)
    assert "1 bucket(s) failed" in message and "t2" in message and "t0" not in message, message
    swapped = wire.clone()
    swapped[8:16], swapped[16:24] = wire[16:24].clone(), wire[8:16].clone()  # two words of t0 trade places
    assert "t0" in damaged(swapped)
    stale = _wire(other, data, version=2)  # another bucket of the same size, with its own valid trailer
    assert all(f"t{i}" in damaged(stale) for i in range(4))
    old = _wire(bucket, data, version=1)  # this bucket from the previous sync
    assert "failed their checksum" in damaged(old)
    truncated = wire.clone()
    truncated[t2 + 4096:bucket.nbytes] = 0  # the end of the data never arrived
    message = damaged(truncated)
    assert "t2" in message and "t3" in message and "t0" not in message, message
    assert damaged(wire, version=3)  # the receiver one sync ahead of what was sent


class RecordingStream:
    """Stands in for a CUDA stream: records the events it was made to wait for."""

    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_ring_hands_out_a_buffer_only_after_its_last_use_was_released():
    ring, stream = Ring([torch.empty(4), torch.empty(4)]), RecordingStream()
    first, second = ring.acquire(stream), ring.acquire(stream)
    assert [first[0], second[0]] == [0, 1] and stream.waited == []  # fresh buffers: nothing to wait for
    with pytest.raises(BufferInFlightError, match="buffer 0 of 2 is needed for use 2 but use 0"):
        ring.acquire(stream)  # buffer 0's transfer has not finished
    ring.release(1, "sent-1")  # out of order: buffer 1 is free, but the turn is buffer 0's
    with pytest.raises(BufferInFlightError):
        ring.acquire(stream)
    ring.release(0, "sent-0")
    slot, buf = ring.acquire(stream)
    assert slot == 0 and buf is first[1] and stream.waited == ["sent-0"]  # the writer waits for the release
    assert ring.acquire(stream)[0] == 1 and stream.waited == ["sent-0", "sent-1"]


def test_host_staging_stages_a_param_once_within_its_budget():
    a, b = torch.arange(24.0).view(4, 6), torch.arange(12.0).view(3, 4)
    staging = HostStaging(torch.device("cpu"), budget=a.numel() * 4)
    left, right = staging.view(a[:, :3]), staging.view(a[:, 3:])  # two column blocks of one param
    assert torch.equal(left, a[:, :3]) and torch.equal(right, a[:, 3:])
    assert left.untyped_storage().data_ptr() == right.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert torch.equal(staging.view(b[1:]), b[1:])
    assert list(staging.staged) == [b.untyped_storage().data_ptr()]  # `a` was evicted to stay within the budget


def test_copy_batch_issues_one_multi_tensor_copy_per_dtype_and_copies_the_rest_one_by_one():
    """Small contiguous pairs share a multi-tensor copy per dtype; strided, converted and big pairs (which `copy_`
    gives the copy engine on GPU) go one by one."""
    gen = torch.Generator().manual_seed(0)
    bucket = torch.zeros(64)
    big = MEMCPY_MIN_BYTES // 4  # float32 elements of the smallest piece copied alone
    full = torch.randn(4, 6, generator=gen)
    pairs = [(bucket[0:6], torch.randn(6, generator=gen)), (bucket[8:20].view(3, 4), torch.randn(3, 4, generator=gen)),
             (torch.zeros(5, dtype=torch.bfloat16), torch.randn(5, generator=gen).bfloat16()),
             (bucket[24:32].view(4, 2), full[:, 2:4]),  # a column block: strided source
             (bucket[32:38], torch.randn(6, generator=gen, dtype=torch.float64)),  # a dtype change
             (torch.zeros(big), torch.randn(big, generator=gen)),  # big: alone
             (torch.zeros(big - 1), torch.randn(big - 1, generator=gen))]  # just below: in the float32 foreach
    batch = CopyBatch()
    for dst, src in pairs:
        batch.add(dst, src)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batch.flush()
    for dst, src in pairs:
        assert torch.equal(dst, src.to(dst.dtype)), (dst, src)
    top = [e.name for e in prof.events() if e.cpu_parent is None and "copy" in e.name]
    # float32 and bfloat16 small contiguous pairs: one multi-tensor copy each; strided, converted and big alone.
    assert sorted(top) == ["aten::_foreach_copy_"] * 2 + ["aten::copy_"] * 3, top
    assert batch.launches == 5 and batch.dsts == [] and batch.srcs == []
