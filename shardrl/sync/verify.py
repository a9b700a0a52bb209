"""Always-on verification of weight sync: a checksum per bucket, computed by the sender before the bucket leaves
and by the receiver when it lands, compared once per sync (one host sync at the end, none per bucket).

The checksum is (sum, xor) of the bucket's int64 words: exact integer arithmetic, so it does not depend on the
reduction order or the device, and any single flipped bit or changed word changes it. `verify: full`
additionally re-sends every bucket and compares each received tensor elementwise with what was loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from shardrl.sync.plan import Bucket

CHUNKS = 16  # the xor runs over the bucket in this many slices; its scratch is one slice (plan.CHECKSUM_RESERVE)


class SyncVerifyError(RuntimeError):
    """Weights arrived different from what was sent; the message names the buckets, ranks and tensors."""


def checksum(data: Tensor) -> Tensor:
    """data: uint8 [n] with n a multiple of 8 -> int64 [2] = (sum of its int64 words modulo 2**64, xor of them).

    Integer reductions wrap around on CPU and CUDA, so both are exact and independent of the reduction order.
    About 40 small kernels and n/16 bytes of scratch, whatever n: cheap next to moving the bucket."""
    words = data.view(torch.int64)  # [n/8]
    if words.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=data.device)
    width = -(-words.numel() // CHUNKS)
    acc = words[:width].clone()  # [width] running xor
    for chunk in words[width:].split(width):
        acc[:chunk.numel()].bitwise_xor_(chunk)
    length = width
    while length > 1:  # fold the top half onto the bottom; an odd middle word stays where it is
        half = length // 2
        acc[:half].bitwise_xor_(acc[length - half:length])
        length -= half
    return torch.stack([words.sum(), acc[0]])


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
