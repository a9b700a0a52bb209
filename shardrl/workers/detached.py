"""The trainer pool's actor in the detached placement (the async modes): `ActorRefWorker` (the same options, the
same log-prob and update code, the same offload handling) plus the sending end of `DetachedSync`. Its rollout pool
counterpart is `workers.rollout.RolloutWorker`; both are in one torch.distributed world, trainer ranks first.

Both workers make the sync group from the registry their layouts use (one group per rank set in a process; see
`parallel.layout.GroupRegistry`), before their layouts, in the same order on every rank.
"""

from __future__ import annotations

from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.controller.rank_env import collective_timeout
from shardrl.job.options import ActorOptions, RefOptions, WeightSyncOptions
from shardrl.parallel.layout import GroupRegistry
from shardrl.sync.detached import DetachedSync
from shardrl.workers.actor import ActorRefWorker


class DetachedActorWorker(ActorRefWorker):
    def __init__(self, actor: ActorOptions, ref: RefOptions | None, weight_sync: WeightSyncOptions, model_path: str,
                 registry: GroupRegistry | None = None) -> None:
        registry = GroupRegistry() if registry is None else registry
        group = registry.sync_group(weight_sync.ranks, collective_timeout())
        super().__init__(actor, ref, model_path, registry)
        self.weight_sync = DetachedSync.sender(self.actor.chunks, self.actor.layout, self.actor.host_buffers, group,
                                               weight_sync.bucket_bytes, weight_sync.verify, collective_timeout())

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def sync_weights(self, version: int) -> dict[str, float]:
        """Send the actor's weights to the rollout pool (with `RolloutWorker.sync_weights` at the same time);
        offloaded params are read from host memory and stay there."""
        return self.weight_sync.sync(version)
