"""Always-on verification of weight sync: a checksum per bucket, computed by the sender before the bucket leaves
and by the receiver when it lands, compared once per sync (one host sync at the end, none per bucket).

The checksum has one int64 per block of `CHECKSUM_BLOCK_BYTES` of the bucket: the sum, modulo 2**64, of the block's
int64 words each times an odd multiplier of its position in the block, plus a salt from the block's index, the
bucket's identity (its place in the plan: pair, step, pieces) and the sync's version. So
* a flipped bit changes its word by +-2**k, times an odd number: never 0 modulo 2**64;
* words that trade places (within a block or between blocks) change a sum, whatever they hold, unless their
  difference times the difference of their multipliers is 0 modulo 2**64 (multipliers are pseudo-random odd
  numbers: for a random pair about 2**-60);
* a buffer holding another bucket, or this bucket of another sync, carries that one's valid trailer, whose salts
  are not this one's; a bucket cut short leaves blocks of zeros or stale bytes under the sums;
* a failing block names the tensors whose pieces overlap it (usually one: blocks are 4 KiB).
On CUDA one Triton kernel reads the bucket once and adds the salts (`checksum_kernel`: one launch per checksum);
elsewhere torch does the same maths 256 blocks at a time.
Integer sums are exact and independent of the reduction order and the device, so both ends agree bit for bit.
`verify: full` additionally re-sends every bucket and compares each received tensor elementwise with what was loaded.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch import Tensor

from shardrl.sync.plan import CHECKSUM_BLOCK_BYTES, Bucket

BLOCK_WORDS = CHECKSUM_BLOCK_BYTES // 8
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: the odd step of the salts and multipliers
_MASK64 = (1 << 64) - 1


class SyncVerifyError(RuntimeError):
    """Weights arrived different from what was sent; the message names the buckets, ranks and tensors."""


_MIX = (-4658895280553007687, -7723592293110705685)  # SplitMix64's 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix(x: Tensor) -> Tensor:
    """A bijective 64-bit mix (SplitMix64's finaliser) of int64 values, wrapping as the hardware does."""
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)  # logical shifts: mask the sign bits an arithmetic shift copies
    x = x * _MIX[0]
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * _MIX[1]
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


_multipliers: dict[torch.device, Tensor] = {}


def multipliers(device: torch.device) -> Tensor:
    """int64 [BLOCK_WORDS]: the odd multiplier of each word position in a block (fixed: both ends share them)."""
    if device not in _multipliers:
        positions = torch.arange(1, BLOCK_WORDS + 1, dtype=torch.int64, device=device)
        _multipliers[device] = _splitmix(positions * _GOLDEN) | 1
    return _multipliers[device]


def _seed(identity: int, version: int) -> int:
    """The int64 seed of a bucket's salts: from its identity and the sync's version."""
    return _to_int64((identity * 0x100000001B3 + version * 0xC2B2AE3D27D4EB4F) & _MASK64)


def salts(num_blocks: int, identity: int, version: int, device: torch.device) -> Tensor:
    """int64 [num_blocks]: what each block's sum is offset by, splitmix(block * golden + seed)."""
    blocks = torch.arange(num_blocks, dtype=torch.int64, device=device)
    return _splitmix(blocks * _GOLDEN + _seed(identity, version))


def _to_int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def checksum(data: Tensor, identity: int = 0, version: int = 0) -> Tensor:
    """data: uint8 [n] with n a multiple of 8 -> int64 [ceil(n / CHECKSUM_BLOCK_BYTES)]: per block, the sum (modulo
    2**64) of its int64 words times their position's multiplier, plus the block's salt (see the module docstring)."""
    words = data.view(torch.int64)
    num_blocks = -(-words.numel() // BLOCK_WORDS)
    if words.is_cuda and words.numel():
        from shardrl.sync.checksum_kernel import salted_block_sums  # Triton: CUDA installs only

        return salted_block_sums(words, multipliers(words.device), num_blocks, BLOCK_WORDS,
                                 _seed(identity, version), _GOLDEN, _MIX)
    return _block_sums(words, multipliers(words.device), num_blocks) + salts(num_blocks, identity, version,
                                                                             words.device)


def _block_sums(words: Tensor, mult: Tensor, num_blocks: int, chunk_blocks: int = 256) -> Tensor:
    """The unsalted block sums with torch, `chunk_blocks` blocks at a time: its scratch (the products) is one chunk,
    at most 1 MiB and never more than the bucket (on 2 CPU cores a 64 MiB bucket took 10 ms, 3x the old
    checksum's single sum; 64-block chunks took 12x as long, smaller ones are loop-bound)."""
    sums = torch.empty(num_blocks, dtype=torch.int64, device=words.device)
    full = words.numel() // BLOCK_WORDS
    for first in range(0, full, chunk_blocks):
        last = min(first + chunk_blocks, full)
        block = words[first * BLOCK_WORDS:last * BLOCK_WORDS].view(last - first, BLOCK_WORDS)
        sums[first:last] = (block * mult).sum(dim=1)
    if full < num_blocks:  # the ragged last block
        tail = words[full * BLOCK_WORDS:]
        sums[full] = (tail * mult[:tail.numel()]).sum()
    return sums


def _describe(bucket: Bucket, names: list[str]) -> str:
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"step {bucket.step} rank {bucket.src} -> rank {bucket.dst}: {shown}"


def check_checksums(buckets: Sequence[Bucket], sent: Sequence[Tensor], received: Sequence[Tensor]) -> None:
    """Per received bucket, the sender's checksum (its trailer) and the receiver's: one host read for them all;
    a mismatch names each failing bucket's damaged tensors (those overlapping a failing block)."""
    if not buckets:
        return
    failed = (torch.cat(list(sent)) != torch.cat(list(received))).nonzero().flatten().tolist()
    if not failed:
        return
    bounds, start = [], 0
    for s in sent:
        bounds.append(start)
        start += s.numel()
    damaged: dict[int, list[str]] = {}
    for flat in failed:
        i = bisect.bisect_right(bounds, flat) - 1
        block = flat - bounds[i]
        names = buckets[i].names_in(block * CHECKSUM_BLOCK_BYTES, (block + 1) * CHECKSUM_BLOCK_BYTES)
        damaged.setdefault(i, [])
        damaged[i].extend(n for n in names if n not in damaged[i])
    raise SyncVerifyError(f"weight sync: {len(damaged)} bucket(s) failed their checksum, damaged tensors: "
                          + "; ".join(_describe(buckets[i], names) for i, names in damaged.items())
                          + " — the transfer corrupted them; the rollout weights are not trustworthy")


def check_full(names: Sequence[str], mismatched: Sequence[Tensor], rank: int) -> None:
    """verify=full: `mismatched[i]` is a bool scalar, true when tensor `names[i]` differs from what was sent."""
    if not names:
        return
    flags = torch.stack(list(mismatched)).cpu().tolist()
    if bad := sorted({name for name, flag in zip(names, flags) if flag}):
        raise SyncVerifyError(f"weight sync (verify=full): rollout rank {rank} holds tensors that differ from the "
                              f"trainer's: {', '.join(bad[:10])}" + (f" and {len(bad) - 10} more" if len(bad) > 10
                                                                     else ""))
