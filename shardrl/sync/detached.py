"""Detached weight sync (the async modes): a trainer pool sends, a separate rollout pool receives, over one sync
group spanning both (NCCL on GPU, gloo on CPU).

Each side builds only its own layout; the sync group and the plan are all a rollout rank knows of the trainer.
Every trainer rank sends the pieces it holds (replicas split the work), in double-buffered buckets; offloaded
params are streamed from pinned host memory and stay offloaded. Both pools call `sync()` at the same point of their
loops (the rollout with no request mid-step: abort/resume around it for partial rollouts).
"""

from __future__ import annotations

import datetime

from shardrl.parallel.layout import sync_group
from shardrl.rollout.engine import Engine
from shardrl.sync.shards import Shards
from shardrl.sync.weight_sync import Verify, WeightSync
from shardrl.workers.engine import ModelEngine

TIMEOUT = datetime.timedelta(minutes=10)


class DetachedSync:
    def __init__(self, weights: WeightSync, rollout: Engine | None) -> None:
        self.weights, self.rollout = weights, rollout

    @classmethod
    def sender(cls, actor: ModelEngine, rollout_ranks: list[int], bucket_bytes: int, verify: Verify = "checksum",
               timeout: datetime.timedelta = TIMEOUT) -> DetachedSync:
        """The trainer side, on every actor rank. Collective over actor and rollout ranks (with `receiver`)."""
        group = sync_group(actor.layout.ranks + list(rollout_ranks), timeout)
        source = Shards(actor.chunks, sending=True, first_stage=actor.layout.is_first_stage)
        return cls(WeightSync(group, actor.layout.device, bucket_bytes, verify, source=source), None)

    @classmethod
    def receiver(cls, rollout: Engine, trainer_ranks: list[int], bucket_bytes: int, verify: Verify = "checksum",
                 timeout: datetime.timedelta = TIMEOUT) -> DetachedSync:
        """The rollout side, on every rollout rank."""
        group = sync_group(list(trainer_ranks) + rollout.layout.ranks, timeout)
        return cls(WeightSync(group, rollout.device, bucket_bytes, verify, target=Shards(rollout.model)), rollout)

    def sync(self, version: int | None = None) -> dict[str, float]:
        """Trainer -> rollout; on the rollout side `policy_version` becomes `version` (default: one more)."""
        metrics = self.weights.sync()
        if self.rollout is not None:
            self.rollout.update_weights((), version)  # only sets the policy version: the weights are in place
        return metrics
