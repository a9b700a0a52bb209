"""Always-on verification of weight sync: a checksum per bucket, computed by the sender before the bucket leaves
and by the receiver when it lands, compared once per sync (one host sync at the end, none per bucket).

The checksum is (sum of the bucket's int32 words, xor of its int64 words): exact integer arithmetic, so it does not
depend on the reduction order or the device, and any single flipped bit or lost word changes it. `verify: full`
additionally re-sends every bucket and compares each received tensor elementwise with what was loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from shardrl.sync.plan import Bucket

CHUNKS = 64  # the bucket is reduced in this many slices: scratch stays below 1/16 of it (plan.CHECKSUM_RESERVE)


class SyncVerifyError(RuntimeError):
    """Weights arrived different from what was sent; the message names the buckets, ranks and tensors."""


def checksum(data: Tensor) -> Tensor:
    """data: uint8 [n] with n a multiple of 8 -> int64 [2] = (sum of int32 words, xor of int64 words).

    Scratch: the running xor (n/64 bytes) and, on CPU, one slice's int32 words widened to int64 (n/32 bytes)."""
    words = data.view(torch.int64)  # [n/8]
    total = torch.zeros(1, dtype=torch.int64, device=data.device)
    if words.numel() == 0:
        return torch.cat([total, total])
    width = -(-words.numel() // CHUNKS)
    acc = words[:width].clone()  # [width] running xor
    for i, chunk in enumerate(words.split(width)):
        if i:
            acc[:chunk.numel()].bitwise_xor_(chunk)
        total += chunk.view(torch.int32).sum(dtype=torch.int64)
    while acc.numel() > 1:
        half = acc.numel() // 2
        folded = acc[:half] ^ acc[half:2 * half]
        if acc.numel() % 2:
            folded[:1].bitwise_xor_(acc[-1:])
        acc = folded
    return torch.cat([total, acc])


def _describe(bucket: Bucket) -> str:
    names = bucket.names()
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return f"step {bucket.step} rank {bucket.src} -> rank {bucket.dst} ({shown})"


def check_checksums(buckets: Sequence[Bucket], sums: Tensor) -> None:
    """sums [len(buckets), 2, 2]: per received bucket the sender's checksum and the receiver's."""
    if not buckets:
        return
    bad = (sums[:, 0] != sums[:, 1]).any(dim=-1).nonzero().flatten().tolist()
    if bad:
        raise SyncVerifyError(f"weight sync: {len(bad)} bucket(s) failed their checksum: "
                              + "; ".join(_describe(buckets[i]) for i in bad)
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
