"""One rank's end of the trainer -> rollout weight transfer: the plan, built once, and `sync()` that executes it.

A rank may be a sender (it holds trainer shards), a receiver (rollout shards) or both (colocated). Construction is
collective over the sync group: every rank contributes the `Slice`s it holds or needs, and every rank computes the
same plan from them, so the rollout side learns what it will receive without building the trainer's layout.

`ColocatedSync` and `DetachedSync` take the trainer's side as what it is made of (model chunks, layout, the host
buffers of offloaded params) and the rollout engine as `SyncedRollout`: the few things a sync touches of it.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardrl.errors import first_line
from shardrl.parallel.layout import Layout
from shardrl.sync.plan import SyncPlan, plan_transfers
from shardrl.sync.shards import Shards
from shardrl.sync.transport import Transport
from shardrl.sync.watch import SyncWatch

Verify = Literal["checksum", "full"]


class SyncedRollout(Protocol):
    """What weight sync uses of a rollout engine (`shardrl.rollout.engine.Engine` is one): the model whose shards
    it writes, the layout they are laid out by, and the call that stamps the new policy version once they are in."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def layout(self) -> Layout: ...

    def set_policy_version(self, version: int | None = None, rewritten: Iterable[nn.Parameter] = ()) -> None: ...

    def refuse_torn_weights(self, reason: str) -> None: ...


def _gather(group: dist.ProcessGroup | None, item: object) -> tuple[list[int], list]:
    """(global ranks, each rank's item) over `group`; just this process without one."""
    if group is None:
        return [dist.get_rank() if dist.is_initialized() else 0], [item]
    items: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(items, item, group=group)
    return dist.get_process_group_ranks(group), items


def describe_ranks(ranks: Sequence[int], every: Sequence[tuple]) -> dict[int, str]:
    """Each rank of the sync group as an error names it: global rank, role in the sync and host (the last item of
    what it contributed to the plan; the first two are its trainer and rollout slices)."""
    roles = {(True, False): "trainer", (False, True): "rollout", (True, True): "trainer+rollout",
             (False, False): "idle"}
    return {rank: f"global rank {rank} ({roles[item[0] is not None, item[1] is not None]} on {item[-1]})"
            for rank, item in zip(ranks, every)}


class WeightSync:
    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, bucket_bytes: int,
                 verify: Verify = "checksum", source: Shards | None = None, target: Shards | None = None,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> None:
        """`source`: this rank's trainer shards (None on rollout-only ranks); `target`: its rollout shards (None on
        trainer-only ranks). `bucket_bytes`: the most buffer memory a transfer direction uses, double-buffered.
        `timeout`: the group's collective timeout (`trainer.collective_timeout_s`); a sync whose peer stops is
        reported, naming it, before it runs out (`watch.SyncWatch`).

        With LoRA adapters in the model the first sync moves every tensor and later ones the adapters alone (the
        base weights are frozen, so the rollout's copy stays right): a second plan over the adapters' slices."""
        self.device, self.verify, self.source, self.target = torch.device(device), verify, source, target
        adapters = (source.adapters_only() if source else None, target.adapters_only() if target else None)
        mine = tuple(shards.slices() if shards else None for shards in (source, target, *adapters))
        ranks, every = _gather(group, (*mine, socket.gethostname()))
        self.rank = ranks[0] if group is None else dist.get_rank()
        peers = describe_ranks(ranks, every)
        watch = SyncWatch(timeout, poll_at_end=self.device.type == "cuda")

        def transport(held_at: int, sending: Shards | None, receiving: Shards | None) -> tuple[SyncPlan, Transport]:
            holdings = {r: item[held_at] for r, item in zip(ranks, every) if item[held_at] is not None}
            needs = {r: item[held_at + 1] for r, item in zip(ranks, every) if item[held_at + 1] is not None}
            plan = plan_transfers(holdings, needs, bucket_bytes)
            return plan, Transport(plan.for_rank(self.rank), group, self.device, sending, receiving, watch, peers)

        self.plan, self.transport = transport(0, source, target)
        has_adapters = any(item[2] or item[3] for item in every)
        self.adapter_plan, self.adapter_transport = transport(2, *adapters) if has_adapters else (None, None)
        self.synced = False
        self.moved_everything = False  # the last sync moved every tensor (the first one), not the adapters alone

    def sync(self) -> dict[str, float]:
        """Move the current trainer weights into the rollout shards (after the first sync of a LoRA model: its
        adapters) and verify them; returns this rank's metrics (`sync/bytes`: bytes loaded into its rollout shards,
        or sent by a trainer-only rank)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        for padding in self.target.padding() if self.target else ():
            padding.zero_()
        transport = self.adapter_transport if self.synced and self.adapter_transport else self.transport
        self.moved_everything = transport is self.transport
        stats = transport.run()
        if self.verify == "full":
            transport.run(compare=True)
        self.synced = True
        if cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        # On CPU the buffers are the measurable part; on GPU the allocator's peak is (buffers, scratch, staging).
        peak = torch.cuda.max_memory_allocated(self.device) - base if cuda else stats.buffer_bytes
        moved = stats.bytes_received + stats.bytes_local if self.target else stats.bytes_sent
        return {"sync/bytes": float(moved), "sync/seconds": seconds, "sync/gbps": moved / max(seconds, 1e-9) / 1e9,
                "sync/buckets": float(stats.buckets), "sync/peak_extra_bytes": float(peak),
                "sync/bytes_sent": float(stats.bytes_sent), "sync/bytes_received": float(stats.bytes_received),
                "sync/bytes_local": float(stats.bytes_local), "sync/bytes_host_read": float(stats.host_read_bytes),
                "sync/copy_launches": float(stats.copy_launches)}


@contextlib.contextmanager
def applied_to(rollout: SyncedRollout) -> Iterator[None]:
    """Run a sync into `rollout`'s shards: if it fails, the shards hold a mix of two versions (they are written in
    place as buckets arrive), so the rollout is told to refuse generating until a later sync completes. It does not
    keep a copy of its previous weights to fall back on: that would double the rollout's weight memory or move
    every synced byte over PCIe a second time, and no run goes on past a failed sync (a resumed run syncs the
    rollout to the checkpoint's weights before it generates)."""
    try:
        yield
    except BaseException as exc:
        rollout.refuse_torn_weights(f"{type(exc).__name__}: {first_line(exc)}")
        raise


def rewritten_by(sync: WeightSync, rollout: SyncedRollout) -> Iterable[nn.Parameter]:
    """The rollout weights a sync that just ran wrote besides the adapters: all of them after a sync that moved
    every tensor (`SyncedRollout.set_policy_version` re-takes its pristine base copies of them), else none."""
    return rollout.model.parameters() if sync.moved_everything else ()
