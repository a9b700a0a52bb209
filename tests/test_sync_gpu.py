"""Weight sync over NCCL on 2 GPUs: the same checks as the gloo tests (bitwise shards and generation against the
trainer's HF export, offloaded params stay offloaded, peak memory from the CUDA allocator), on the paths only a
GPU takes: pinned host -> device copies, offloaded params staged for column blocks and dtype changes."""

import pytest
import torch

from shardrl.parallel.launch import run_distributed
from test_sync import MOE_TP2, Case, check_synced, checkpoints, run_cases  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

BUCKET = 64 << 10
SLACK = 64 * 512  # the CUDA allocator rounds every block up to 512 bytes
CASES = [
    # trainer TP1 (2 DP replicas) -> rollout TP2: column blocks of offloaded fp32 params, converted to bf16
    Case("dense", {}, 2, dict(tp=2), 2, "colocated", True, torch.bfloat16, bucket=BUCKET),
    Case("moe", dict(ep=2), 2, MOE_TP2, 2, "colocated", True, bucket=BUCKET, verify="full"),
    Case("dense", dict(tp=2), 2, {}, 2, "colocated", False, bucket=BUCKET),
    Case("dense", {}, 1, {}, 1, "detached", True, torch.bfloat16, bucket=BUCKET),  # one GPU sends, one receives
]


def test_sync_over_nccl(checkpoints, tmp_path):
    results = run_distributed(2, run_cases, CASES, checkpoints, str(tmp_path), backend="nccl")
    for i, case in enumerate(CASES):
        check_synced(case, [rank_results[i] for rank_results in results], allocator_slack=SLACK)
