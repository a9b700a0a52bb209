"""Single controller on Ray: resource pools, worker groups of one actor per rank, dispatch of calls over ranks."""

from shardrl.controller.cluster import init_ray
from shardrl.controller.dispatch import Dispatch, DispatchError, dispatch_mode
from shardrl.controller.group import PendingCall, Role, RoleHandle, WorkerError, WorkerGroup
from shardrl.controller.host import collective_timeout, init_distributed_from_env
from shardrl.controller.pool import ResourcePool, ResourcePoolError

__all__ = [
    "Dispatch", "DispatchError", "PendingCall", "ResourcePool", "ResourcePoolError", "Role", "RoleHandle",
    "WorkerError", "WorkerGroup", "collective_timeout", "dispatch_mode", "init_distributed_from_env", "init_ray",
]
