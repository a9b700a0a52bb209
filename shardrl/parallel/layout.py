"""The one place that creates process groups.

A `Layout` describes how one model role (actor, ref, critic, rollout) is spread over a contiguous block of global
ranks (its `LayoutSpec` and rank order: layout_spec.py), and holds every process group that role needs. Layers
receive the groups they use from it; the groups come from a `GroupRegistry`, one per process shared by all its
layouts and its weight-sync group (see there why); nothing else in shardrl calls `torch.distributed.new_group`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardrl.parallel.layout_spec import GROUP_NAMES, LayoutError, LayoutSpec, rank_tables


def _torch_group_state() -> tuple[int, dist.Store]:
    """The number of groups this process has registered with torch, and the default group's store.

    torch (2.13) names a group made with use_local_synchronization from its ranks and exactly this number
    (`len(_world.pg_names)` in `_hash_ranks_to_str`), and its members meet in exactly this store, so reading them is
    the only way to make that name agree. No public API gives either: `dist.get_pg_count()` counts only the groups
    made without use_local_synchronization, and the default store is not exposed. Private, so read here only.
    """
    c10d = dist.distributed_c10d
    return len(c10d._world.pg_names), c10d._get_default_store()


def _agree_group_count(ranks: tuple[int, ...], timeout: datetime.timedelta) -> None:
    """Raise this process's group count to the highest among the members of the group about to be made over `ranks`
    (sorted), so that torch gives all of them the same group name. Collective over `ranks` only.

    Each member publishes its count under a key of this rank set and of its own occurrence number for it (the n-th
    group any registry of this process makes over these ranks meets the other members' n-th), then makes one-rank
    groups until it reaches the maximum. Those are made like the real group (default backend, so NCCL on GPU) but
    carry no collective, so their NCCL communicators are never started (the default group binds no device, see
    `launch.join_default_group`); a process makes at most as many as the group counts differ by.
    """
    count, store = _torch_group_state()
    me = dist.get_rank()
    rank_set = "_".join(map(str, ranks))
    occurrence = store.add(f"shardrl/group_counts/{rank_set}/made_by/{me}", 1)
    keys = [f"shardrl/group_counts/{rank_set}/{occurrence}/{rank}" for rank in ranks]
    store.set(keys[ranks.index(me)], str(count))
    try:
        store.wait(keys, timeout)
    except dist.DistStoreError:  # the store's wait ends in this error when `timeout` passes
        missing = [rank for rank, key in zip(ranks, keys) if not store.check([key])]
        raise TimeoutError(f"group over ranks {list(ranks)}: ranks {missing} did not start making it within "
                           f"{timeout}; every member must build the same layouts and sync groups") from None
    highest = max(int(value) for value in store.multi_get(keys))
    for _ in range(highest - count):
        dist.new_group([me], timeout=timeout, use_local_synchronization=True)


class GroupRegistry:
    """The process groups one process made over the current torch.distributed world, one per set of ranks.

    torch (2.13) names a group made with use_local_synchronization from its ranks and the number of groups this
    process made before, and its members meet on keys derived from that name: members that made different numbers
    of groups before would never meet, and the group would hang. Ranks' counts do differ (at PP>=3 the middle stages
    make no embedding group; a rollout pool makes none of the trainer's; ranks 0 and 3 may share a group the others
    lack), so before making a group its members agree on that number through the default store and the ones behind
    catch up with unused one-rank groups (`_agree_group_count`). Any rank set can therefore be made at any time, in
    any process, as long as two members make the groups they share in the same order (as the layout tables do).

    A group over a rank set is made only once per registry: every layout of a process (pp and mp at TP=1, a ref
    layout beside the actor's, the rollout beside the actor) and its sync group (the colocated one is the actor's
    world group) take their groups from ONE registry, which saves NCCL communicators; the first creator's timeout
    applies. Whoever builds several layouts in one process owns the registry and passes it to each `Layout.create`
    (the Ray rank host gives every role it hosts the same one). Make a new one after re-initialising
    torch.distributed.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def get(self, ranks: list[int], timeout: datetime.timedelta) -> dist.ProcessGroup:
        """The group over `ranks` (made on first use; collective over `ranks` only, so other roles' ranks never
        block on it). Raises TimeoutError naming the members that did not start making it within `timeout`."""
        key = tuple(sorted(set(ranks)))  # torch sorts a group's ranks too
        if key not in self._groups:
            _agree_group_count(key, timeout)
            self._groups[key] = dist.new_group(list(key), timeout=timeout, use_local_synchronization=True)
        return self._groups[key]

    def rank_sets(self) -> list[tuple[int, ...]]:
        """The sorted ranks of every group this registry made, in the order it made them."""
        return list(self._groups)

    def sync_group(self, ranks: list[int], timeout: datetime.timedelta = datetime.timedelta(minutes=10)
                   ) -> dist.ProcessGroup | None:
        """The weight-sync group over explicit global `ranks`, which may span several roles' layouts (a trainer
        pool's senders and a rollout pool's receivers, or the colocated ranks). Collective over `ranks` only, so a
        rollout-only worker joins this group and its own layout's, never the trainer's. None for a single rank.
        Colocated ranks get their layouts' world group from this registry. Members that also share other groups
        must ask for this one at the same point relative to those (see `GroupRegistry`)."""
        ranks = sorted(set(ranks))
        if len(ranks) == 1:
            return None
        if not dist.is_initialized() or dist.get_rank() not in ranks:
            raise LayoutError(f"sync group over ranks {ranks}: this process is not one of them (or "
                              f"torch.distributed is not initialised)")
        return self.get(ranks, timeout)


@dataclass
class Layout:
    """Process groups and coordinates of this process for one role.

    Build with `Layout.create(spec, ranks)` on every rank of `ranks` (ranks outside the block do not participate and
    build nothing, so a rollout-only worker never creates the trainer's groups). With a world of one process, or when
    torch.distributed is not initialised, use `Layout.single()`: all groups are None and all sizes are 1.

    A process that builds more than one layout, or a sync group beside its layouts, passes ONE `GroupRegistry` to
    all of them (`registry=`; one group per rank set, see `GroupRegistry`), e.g. `other.registry` of a layout it
    already built. Without one, a layout gets a registry of its own: enough for a process with a single layout.
    """

    spec: LayoutSpec
    ranks: list[int]
    local_rank: int  # index of this process inside `ranks`
    device: torch.device
    coords: dict[str, int]
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    registry: GroupRegistry = field(default_factory=GroupRegistry)  # where `groups` came from (pass it on)

    @classmethod
    def single(cls, device: torch.device | str = "cpu", registry: GroupRegistry | None = None) -> Layout:
        spec = LayoutSpec(world_size=1)
        names = GROUP_NAMES
        me = dist.get_rank() if dist.is_initialized() else 0
        return cls(spec, [me], 0, torch.device(device), spec.coords(0), {n: None for n in names},
                   {n: [me] for n in names}, GroupRegistry() if registry is None else registry)

    @classmethod
    def create(
        cls,
        spec: LayoutSpec,
        ranks: list[int] | None = None,
        device: torch.device | str | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=10),
        registry: GroupRegistry | None = None,
    ) -> Layout:
        """Create this rank's groups of the layout, or take them from `registry` where it already holds a group over
        the same ranks. Collective over `ranks` only."""
        registry = GroupRegistry() if registry is None else registry
        if not dist.is_initialized():
            if spec.world_size != 1:
                raise LayoutError(f"a layout of world size {spec.world_size} needs torch.distributed initialised")
            return cls.single(device or "cpu", registry)
        ranks = list(range(spec.world_size)) if ranks is None else list(ranks)
        me = dist.get_rank()
        if me not in ranks:
            raise LayoutError(f"rank {me} is not in this layout's ranks {ranks}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        tables = rank_tables(spec, ranks)
        groups: dict[str, dist.ProcessGroup | None] = {}
        group_ranks: dict[str, list[int]] = {}
        for name, table in tables.items():
            # Middle pipeline stages are in no "embedding" group (they hold no tied embedding): a group of one.
            mine = next((g for g in table if me in g), [me])
            group_ranks[name] = mine
            groups[name] = registry.get(mine, timeout) if len(mine) > 1 else None
        local = ranks.index(me)
        return cls(spec, ranks, local, torch.device(device), spec.coords(local), groups, group_ranks, registry)

    def size(self, name: str) -> int:
        """Ranks in this process's group `name` (one of `GROUP_NAMES`)."""
        return len(self.group_ranks[name])

    def rank(self, name: str) -> int:
        """This process's index inside its group `name`."""
        return self.group_ranks[name].index(self.ranks[self.local_rank])

    def group(self, name: str) -> dist.ProcessGroup | None:
        """This process's group `name`; None when it is the process alone."""
        return self.groups[name]

    # Named accessors for the groups the code base reads, so each is typed and can be followed to its definition.
    # Only the names in use exist; for any other group call size/rank/group(name).

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks: how many shards of each dense weight one copy of the model is cut into."""
        return self.size("tp")

    @property
    def tp_rank(self) -> int:
        """Which tensor-parallel shard of the dense weights this rank holds."""
        return self.rank("tp")

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel group: the dense layers' collectives."""
        return self.group("tp")

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks (each holding a piece of every sequence)."""
        return self.size("cp")

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of the dense weights: how many ways a batch is split."""
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this rank is: which share of a batch it takes."""
        return self.rank("dp")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group: the dense replicas of this rank's shards."""
        return self.group("dp")

    @property
    def pp_size(self) -> int:
        """Pipeline stages."""
        return self.size("pp")

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.rank("pp")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline group: the stages holding the rest of this rank's copy of the model."""
        return self.group("pp")

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        """Data- and context-parallel ranks together: where dense gradients are reduced when CP is on."""
        return self.group("dp_cp")

    @property
    def tp_cp_group(self) -> dist.ProcessGroup | None:
        """Tensor- and context-parallel ranks together: the ranks whose tokens make up one replica's micro batch
        (sequence parallelism cuts it over TP, context parallelism over CP)."""
        return self.group("tp_cp")

    @property
    def ep_size(self) -> int:
        """Expert-parallel ranks: how many ways an MoE layer's experts are divided."""
        return self.size("ep")

    @property
    def ep_rank(self) -> int:
        """Which run of experts this rank holds."""
        return self.rank("ep")

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group: the ranks holding the other experts of a layer."""
        return self.group("ep")

    @property
    def etp_size(self) -> int:
        """Expert tensor-parallel ranks: how many shards each expert's weights are cut into."""
        return self.size("etp")

    @property
    def etp_rank(self) -> int:
        """Which expert tensor-parallel shard this rank holds."""
        return self.rank("etp")

    @property
    def etp_group(self) -> dist.ProcessGroup | None:
        """The expert tensor-parallel group: the experts' collectives."""
        return self.group("etp")

    @property
    def edp_size(self) -> int:
        """Expert data-parallel replicas of this rank's expert shards."""
        return self.size("edp")

    @property
    def ep_etp_size(self) -> int:
        """Ranks of the MoE token dispatch (EP x ETP)."""
        return self.size("ep_etp")

    @property
    def ep_etp_group(self) -> dist.ProcessGroup | None:
        """The MoE layers' token dispatch group (EP x ETP)."""
        return self.group("ep_etp")

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank of the layout (checkpoints; other roles' ranks take no part)."""
        return self.group("world")

    @property
    def embedding_group(self) -> dist.ProcessGroup | None:
        """The first and last pipeline stage, which both hold the tied embedding; None on the middle stages."""
        return self.group("embedding")

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.spec.pp - 1
