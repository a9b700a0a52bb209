"""Always-on verification of weight sync: a checksum per bucket, computed by the sender before the bucket leaves
and by the receiver when it lands, compared once per sync (one host sync at the end, none per bucket).

The checksum is the bucket's int64 words cut into `CHECKSUM_WORDS` consecutive runs, each run summed modulo 2**64:
one reduction kernel reading the bucket once (plus one for a ragged tail). Integer sums are exact and independent
of the reduction order and the device; a flipped bit changes its word by +-2**k, which is never 0 modulo 2**64, so
any single flipped bit or changed word changes its run's sum, and words swapped between runs change two sums.
`verify: full` additionally re-sends every bucket and compares each received tensor elementwise with what was loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from shardrl.sync.plan import CHECKSUM_WORDS, Bucket


class SyncVerifyError(RuntimeError):
    """Weights arrived different from what was sent; the message names the buckets, ranks and tensors."""


def checksum(data: Tensor) -> Tensor:
    """data: uint8 [n] with n a multiple of 8 -> int64 [CHECKSUM_WORDS]: the sums (wrapping modulo 2**64, as
    integer reductions do on CPU and CUDA) of its int64 words in CHECKSUM_WORDS consecutive runs of equal length,
    the last run also taking the words left over."""
    words = data.view(torch.int64)  # [n/8]
    width = words.numel() // CHECKSUM_WORDS
    sums = words[:width * CHECKSUM_WORDS].view(CHECKSUM_WORDS, width).sum(dim=1)  # [CHECKSUM_WORDS]
    if words.numel() % CHECKSUM_WORDS:
        sums[-1] += words[width * CHECKSUM_WORDS:].sum()
    return sums


def _describe(bucket: Bucket) -> str:
    names = bucket.names()
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return f"step {bucket.step} rank {bucket.src} -> rank {bucket.dst} ({shown})"


def check_checksums(buckets: Sequence[Bucket], sums: Tensor) -> None:
    """sums [len(buckets), 2, CHECKSUM_WORDS]: per received bucket the sender's checksum and the receiver's."""
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
