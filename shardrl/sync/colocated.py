"""Colocated weight sync (the hybrid engine): actor and rollout engine in the same process on every rank.

The plan maps the actor's layout onto the rollout's over the ranks both use: a piece this rank's actor shard holds
is copied straight into its rollout shard (no bucket), the rest arrives from the other ranks in buckets. The rollout
wakes its weights first and its KV cache only after the sync, so the cache and the sync buffers never peak
together; offloaded actor params are read from pinned host memory and stay offloaded.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Protocol

from torch import nn

from shardrl.parallel.layout import Layout

from shardrl.parallel.layout_spec import LayoutError
from shardrl.parallel.offload import HostBuffers
from shardrl.sync.shards import Shards
from shardrl.sync.weight_sync import SyncedRollout, Verify, WeightSync, applied_to, rewritten_by


class SleepingRollout(SyncedRollout, Protocol):
    """A rollout engine sharing its GPU with the actor: asleep while the actor trains, woken around a sync."""

    def wake_up(self, kv_cache: bool = True) -> None: ...


class ColocatedSync:
    def __init__(self, chunks: Sequence[nn.Module], layout: Layout, host: HostBuffers, rollout: SleepingRollout,
                 bucket_bytes: int, verify: Verify = "checksum",
                 timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> None:
        """`chunks`, `layout`: this rank's actor model chunks and their layout; `host`: where the actor's offloaded
        params are. Collective over the actor's and rollout's ranks (builds the plan). Both layouts must come from
        one `GroupRegistry`: the sync group over their ranks is then the actor's world group, made nowhere anew."""
        self.rollout = rollout
        registry = layout.registry
        if rollout.layout.registry is not registry:
            raise LayoutError("colocated sync: the actor's and the rollout's layouts were built with different "
                              "GroupRegistry objects; pass one registry to both Layout.create calls")
        group = registry.sync_group(layout.ranks + rollout.layout.ranks, timeout)
        source = Shards(chunks, sending=True, first_stage=layout.is_first_stage, host=host)
        self.weights = WeightSync(group, rollout.layout.device, bucket_bytes, verify, source, Shards(rollout.model),
                                  timeout)

    def sync(self, version: int | None = None) -> dict[str, float]:
        """Actor -> rollout; the rollout's `policy_version` becomes `version` (default: one more). A sync that
        fails leaves the rollout refusing to generate until one completes (`applied_to`)."""
        self.rollout.wake_up(kv_cache=False)
        with applied_to(self.rollout):
            metrics = self.weights.sync()
        self.rollout.set_policy_version(version, rewritten_by(self.weights, self.rollout))
        self.rollout.wake_up()
        return metrics
