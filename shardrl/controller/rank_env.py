"""The environment contract of one rank (what the controller sets in each rank's Ray actor, what the rank reads):
the variables `torch.distributed` and `run_distributed` use, plus our collective timeout and device. Ray-free, so
the workers, which read the timeout, import no Ray where they run without it (tests, benches)."""

from __future__ import annotations

import datetime
import os
from typing import Literal

from shardrl.parallel.launch import join_default_group

DEVICE_ENV = "SHARDRL_DEVICE"
COLLECTIVE_TIMEOUT_ENV = "SHARDRL_COLLECTIVE_TIMEOUT_S"


def rank_env(
    rank: int,
    world_size: int,
    local_rank: int,
    master_addr: str,
    master_port: int,
    device: Literal["cpu", "cuda"],
    collective_timeout: datetime.timedelta,
) -> dict[str, str]:
    """Environment of one rank; on CUDA, Ray has already narrowed CUDA_VISIBLE_DEVICES to the rank's GPU."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        DEVICE_ENV: device,
        COLLECTIVE_TIMEOUT_ENV: str(collective_timeout.total_seconds()),
    }


def collective_timeout() -> datetime.timedelta:
    """The group's collective timeout, for process groups a worker builds itself (`Layout.create(timeout=...)`)."""
    return datetime.timedelta(seconds=float(os.environ[COLLECTIVE_TIMEOUT_ENV]))


def init_distributed_from_env() -> None:
    """Join the default process group described by `rank_env` (gloo on CPU, NCCL on the one visible GPU)."""
    backend = "nccl" if os.environ[DEVICE_ENV] == "cuda" else "gloo"
    join_default_group(
        int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), backend, collective_timeout(), cuda_index=0
    )
