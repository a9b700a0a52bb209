"""What the weight-sync checksum costs on one GPU: the position-bound block checksum (`verify.checksum`, one
Triton pass) against the earlier order-free one (sums of 8 runs of int64 words, one torch reduction), per bucket,
next to the time that bucket's bytes take to move: a device-to-device copy (what a colocated local copy costs) and
NVLink at a nominal 400 GB/s (what a peer-to-peer bucket costs; this machine has one GPU). Every bucket is
checksummed twice (sender and receiver), on streams that overlap the transfers.

    python bench/sync_checksum.py
"""

from __future__ import annotations

import argparse

import torch

from shardrl.sync.verify import checksum

NVLINK_BYTES_PER_S = 400e9


def old_checksum(data: torch.Tensor) -> torch.Tensor:
    """The order-free checksum it replaced: int64 sums of 8 consecutive runs of words."""
    words = data.view(torch.int64)
    width = words.numel() // 8
    return words[:width * 8].view(8, width).sum(dim=1)


def seconds(fn, repeats: int) -> float:
    """Median over `repeats` CUDA-event timings of one call, after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for mib in args.sizes_mib:
        data = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8, device="cuda")
        target = torch.empty_like(data)
        new = seconds(lambda: checksum(data, 123, 4), args.repeats)
        old = seconds(lambda: old_checksum(data), args.repeats)
        copy = seconds(lambda: target.copy_(data), args.repeats)
        nvlink = data.numel() / NVLINK_BYTES_PER_S
        print(f"{mib:5d} MiB bucket: new checksum {new * 1e6:8.1f} us ({data.numel() / new / 1e9:6.0f} GB/s), old "
              f"{old * 1e6:8.1f} us, new/old {new / old:.2f}x; device copy {copy * 1e6:8.1f} us -> two checksums "
              f"{2 * new / copy:.1%} of it; NVLink at 400 GB/s {nvlink * 1e6:8.1f} us -> {2 * new / nvlink:.1%}",
              flush=True)


if __name__ == "__main__":
    main()
