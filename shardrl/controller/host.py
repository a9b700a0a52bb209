"""What runs inside each rank's Ray actor: the rank's environment, its process group, and its role objects.

Worker classes are plain Python classes that find torch.distributed already initialised (STYLE #5): a test builds
them under `run_distributed`, the controller builds them here. The env contract below is the same one
`torch.distributed` and `run_distributed` use, plus our collective timeout and device.

Several roles (actor + rollout + ref, verl's "hybrid engine") live in one host and so share one process and one
default process group; each role builds its own `Layout` over the same ranks, all from the host's one
`GroupRegistry` (passed to every role as `registry`), so a rank set's group is made once per process.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Literal

import ray

from shardrl.parallel.launch import free_port, join_default_group
from shardrl.parallel.layout import GroupRegistry

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


class RankHost:
    """One rank's process: holds the role objects and runs their methods for the controller."""

    def __init__(self) -> None:
        self.roles: dict[str, Any] = {}
        self.registry: GroupRegistry | None = None  # made with the default group, in `join`

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port on it (asked of rank 0 for the group's MASTER_ADDR/PORT)."""
        return ray.util.get_node_ip_address(), free_port("")

    def join(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        init_distributed_from_env()
        self.registry = GroupRegistry()

    def add_role(self, name: str, cls: type, kwargs: dict[str, Any]) -> None:
        """Build `cls(**kwargs, registry=...)`: every role class takes the process's `GroupRegistry`."""
        self.roles[name] = cls(**kwargs, registry=self.registry)

    def run(self, role: str, method: str, payload: tuple[tuple, dict[str, Any]], keep_result: bool) -> Any:
        """Call `role.method(*args, **kwargs)`; ranks whose output the dispatch mode ignores return None to save
        the transfer."""
        args, kwargs = payload
        result = getattr(self.roles[role], method)(*args, **kwargs)
        return result if keep_result else None
