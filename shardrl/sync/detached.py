"""Detached weight sync (the async modes): a trainer pool sends, a separate rollout pool receives, over one sync
group spanning both (NCCL on GPU, gloo on CPU).

Each side builds only its own layout; the sync group and the plan are all a rollout rank knows of the trainer.
Every process of both pools makes the group from the registry its Layout uses
(`parallel.layout.GroupRegistry.sync_group`, which makes the members agree on torch's group count first, so any order
works) and hands it to `sender` / `receiver`.
Every trainer rank sends the pieces it holds (replicas split the work), in double-buffered buckets; offloaded
params are streamed from pinned host memory and stay offloaded. Both pools call `sync()` at the same point of their
loops (the rollout with no request mid-step: abort/resume around it for partial rollouts).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from shardrl.parallel.layout import Layout
from shardrl.parallel.offload import HostBuffers
from shardrl.sync.shards import Shards
from shardrl.sync.weight_sync import SyncedRollout, Verify, WeightSync, applied_to, rewritten_by


class DetachedSync:
    def __init__(self, weights: WeightSync, rollout: SyncedRollout | None) -> None:
        self.weights, self.rollout = weights, rollout

    @classmethod
    def sender(cls, chunks: Sequence[nn.Module], layout: Layout, host: HostBuffers, group: dist.ProcessGroup,
               bucket_bytes: int, verify: Verify = "checksum",
               timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> DetachedSync:
        """The trainer side, on every actor rank: its model `chunks`, their `layout` and `host`, where its offloaded
        params are; `timeout`: the group's. Collective over the group (with `receiver` on the rollout ranks)."""
        source = Shards(chunks, sending=True, first_stage=layout.is_first_stage, host=host)
        return cls(WeightSync(group, layout.device, bucket_bytes, verify, source=source, timeout=timeout), None)

    @classmethod
    def receiver(cls, rollout: SyncedRollout, group: dist.ProcessGroup, bucket_bytes: int,
                 verify: Verify = "checksum",
                 timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> DetachedSync:
        """The rollout side, on every rollout rank."""
        target = Shards(rollout.model)
        return cls(WeightSync(group, rollout.layout.device, bucket_bytes, verify, target=target, timeout=timeout),
                   rollout)

    def sync(self, version: int | None = None) -> dict[str, float]:
        """Trainer -> rollout; on the rollout side `policy_version` becomes `version` (default: one more). A sync
        that fails leaves the rollout refusing to generate until one completes (`applied_to`)."""
        if self.rollout is None:
            return self.weights.sync()
        with applied_to(self.rollout):
            metrics = self.weights.sync()
        self.rollout.set_policy_version(version, rewritten_by(self.weights, self.rollout))
        return metrics
