"""Layout: rank tables against hand-written expectations, impossible layouts, and real groups on gloo; the group
registry that a process's layouts and sync groups share, and groups made after the ranks' group counts diverged."""

import datetime

import pytest
import torch
import torch.distributed as dist

from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import GROUP_NAMES, LayoutError, LayoutSpec, rank_tables


def test_rank_tables_tp2_pp2_dp2_hand_written():
    tables = rank_tables(LayoutSpec(world_size=8, tp=2, pp=2))
    assert tables["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tables["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert tables["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tables["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert tables["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_folding_tp4_pp2_ep4_etp1_on_8():
    spec = LayoutSpec(world_size=8, tp=4, pp=2, ep=4, etp=1)
    assert (spec.dp, spec.edp) == (1, 1)
    tables = rank_tables(spec)
    assert tables["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tables["etp"] == [[r] for r in range(8)]
    assert tables["edp"] == [[r] for r in range(8)]


def test_expert_folding_ep2_etp2_dp4():
    tables = rank_tables(LayoutSpec(world_size=4, ep=2, etp=2))
    assert tables["etp"] == [[0, 1], [2, 3]]
    assert tables["ep"] == [[0, 2], [1, 3]]
    assert tables["edp"] == [[0], [1], [2], [3]]
    assert tables["dp"] == [[0, 1, 2, 3]]


def test_offset_ranks():
    tables = rank_tables(LayoutSpec(world_size=2, tp=2), ranks=[4, 5])
    assert tables["tp"] == [[4, 5]] and tables["dp"] == [[4], [5]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=6, tp=4), "not divisible by TP\\*CP\\*PP"),
        (dict(world_size=8, pp=2, ep=8), "EP\\*ETP = 8\\*1 does not divide world/PP = 8/2"),
        (dict(world_size=4, tp=0), "tp=0"),
        (dict(world_size=2, vpp=2), "virtual pipeline"),
    ],
)
def test_impossible_layouts(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        LayoutSpec(**kwargs)


def _named_accessors_agree(layout: Layout) -> bool:
    """Every named accessor (`tp_size`, `ep_group`, ...) is `size/rank/group(name)` of a real group name."""
    names = [name for name, value in vars(Layout).items() if isinstance(value, property)
             and name.rpartition("_")[2] in ("size", "rank", "group")]
    assert {"tp_size", "tp_rank", "tp_group", "ep_etp_group", "embedding_group"} <= set(names)
    for name in names:
        group, _, kind = name.rpartition("_")
        assert group in GROUP_NAMES, name
        named, looked_up = getattr(layout, name), getattr(layout, kind)(group)
        if (named is not looked_up) if kind == "group" else (named != looked_up):
            return False
    return True


def test_named_accessors_are_the_group_lookups_and_nothing_else():
    layout = Layout.single()
    assert _named_accessors_agree(layout)
    for unknown in ("mp_size", "cp_group", "tp_sizes", "expert_rank"):  # never used, so never defined
        with pytest.raises(AttributeError, match=unknown):
            getattr(layout, unknown)


def _two_layouts() -> dict:
    registry = GroupRegistry()  # one process, two layouts: one registry
    actor = Layout.create(LayoutSpec(world_size=4, tp=2, ep=2), registry=registry)
    critic = Layout.create(LayoutSpec(world_size=4, pp=2), registry=registry)
    # The groups really connect the ranks the tables promise.
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=actor.tp_group)
    c = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(c, group=critic.pp_group)
    return dict(tp=t.item(), pp=c.item(), tp_rank=actor.tp_rank, ep_rank=actor.ep_rank, pp_rank=critic.pp_rank,
                dp_size=actor.dp_size, edp_size=actor.edp_size, first=critic.is_first_stage,
                accessors=_named_accessors_agree(actor) and _named_accessors_agree(critic),
                # Equal rank sets, one group object: the critic's DP pairs are the actor's TP pairs, its PP pairs
                # the actor's DP pairs.
                shared=[critic.dp_group is actor.tp_group, critic.pp_group is actor.dp_group,
                        critic.world_group is actor.world_group],
                rank_sets=registry.rank_sets())


def test_layouts_coexist_on_gloo():
    out = run_distributed(4, _two_layouts)
    assert [o["tp"] for o in out] == [1, 1, 5, 5]
    assert [o["pp"] for o in out] == [2, 4, 2, 4]
    assert [o["tp_rank"] for o in out] == [0, 1, 0, 1]
    assert [o["ep_rank"] for o in out] == [0, 1, 0, 1]
    assert [o["pp_rank"] for o in out] == [0, 0, 1, 1]
    assert all(o["dp_size"] == 2 and o["edp_size"] == 2 for o in out)
    assert [o["first"] for o in out] == [True, True, False, False]
    assert all(o["shared"] == [True, True, True] and o["accessors"] for o in out)
    # The actor's TP (= mp = ep) pairs, DP (= edp) pairs and world; the critic makes no group of its own.
    assert [o["rank_sets"] for o in out] == [[(0, 1), (0, 2), (0, 1, 2, 3)], [(0, 1), (1, 3), (0, 1, 2, 3)],
                                             [(2, 3), (0, 2), (0, 1, 2, 3)], [(2, 3), (1, 3), (0, 1, 2, 3)]]


def _sub_layout_only_on_members() -> list[str]:
    # Ranks 2,3 build a rollout layout alone; ranks 0,1 build a trainer layout alone: neither waits on the other.
    if dist.get_rank() < 2:
        layout = Layout.create(LayoutSpec(world_size=2, tp=2), ranks=[0, 1])
    else:
        layout = Layout.create(LayoutSpec(world_size=2, tp=1), ranks=[2, 3])
    return sorted(n for n, g in layout.groups.items() if g is not None)


def test_disjoint_layouts_build_only_their_groups():
    out = run_distributed(4, _sub_layout_only_on_members)
    assert out[0] == out[1] == ["edp", "mp", "tp", "tp_cp", "world"]  # EP=ETP=1: experts data-parallel over both
    assert out[2] == out[3] == ["dp", "dp_cp", "edp", "world"]


def _registry_sharing() -> dict:
    """A layout without a registry, then (detached style) a sync group before the layouts that share its registry."""
    timeout = datetime.timedelta(seconds=30)  # a rendezvous that cannot complete fails the test instead of hanging
    registry = GroupRegistry()
    alone = Layout.create(LayoutSpec(world_size=4, tp=2), timeout=timeout)  # registry of its own
    leaked = registry.rank_sets()
    sync = registry.sync_group([3, 2, 1, 0], timeout)
    # PP4: the middle stages make no embedding group, so from here the ranks have made different numbers of groups;
    # the second layout makes no group of its own, it takes the first's.
    first = Layout.create(LayoutSpec(world_size=4, pp=4), timeout=timeout, registry=registry)
    second = Layout.create(LayoutSpec(world_size=4, pp=4, vpp=2), timeout=timeout, registry=registry)
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=second.pp_group)
    return dict(leaked=leaked, own_registry=alone.registry is not registry, own_world=alone.world_group is not sync,
                sync_is_layout_group=[first.pp_group is sync, second.world_group is sync,
                                      registry.sync_group(first.ranks + second.ranks, timeout) is sync],
                layouts_share=all(second.group(n) is first.group(n) for n in first.groups),
                embedding=first.embedding_group is not None, total=total.item(), rank_sets=registry.rank_sets())


def test_registry_shares_groups_between_layouts_and_sync_group():
    out = run_distributed(4, _registry_sharing)
    for o in out:
        assert o["leaked"] == [] and o["own_registry"] and o["own_world"]
        assert o["sync_is_layout_group"] == [True, True, True] and o["layouts_share"]
        assert o["total"] == 6.0
    assert [o["embedding"] for o in out] == [True, False, False, True]
    assert [o["rank_sets"] for o in out] == [[(0, 1, 2, 3), (0, 3)], [(0, 1, 2, 3)], [(0, 1, 2, 3)],
                                             [(0, 1, 2, 3), (0, 3)]]


def test_registry_without_torch_distributed():
    registry = GroupRegistry()
    assert Layout.create(LayoutSpec(world_size=1), registry=registry).registry is registry
    assert Layout.single().registry is not registry
    assert registry.sync_group([0]) is None and registry.rank_sets() == []
    with pytest.raises(LayoutError, match=r"sync group over ranks \[0, 1\]: this process is not one of them"):
        registry.sync_group([1, 0])


# Groups made after the members' group counts diverged. torch names such a group from its ranks and the number of
# groups the calling process made before; without the registry's agreement on that number these rendezvous never
# complete. A short timeout turns such a hang into an error.
DIVERGED_TIMEOUT_S = 20


def _sums(layout: Layout, names: tuple[str, ...]) -> list[float]:
    """All-reduce 2**rank over each named group: the sum says which ranks the group really joined."""
    sums = []
    for name in names:
        value = torch.tensor([float(2 ** dist.get_rank())])
        dist.all_reduce(value, group=layout.group(name))
        sums.append(value.item())
    return sums


def _tp2_after_pp4() -> dict:
    timeout = datetime.timedelta(seconds=DIVERGED_TIMEOUT_S)
    layouts = []
    # A second registry in the same process (a role given its own) makes the same rank sets once more, again after
    # the counts diverged: its groups must not meet the first registry's.
    for registry in (GroupRegistry(), GroupRegistry()):
        Layout.create(LayoutSpec(world_size=4, pp=4), timeout=timeout, registry=registry)  # only 0, 3: embedding
        layouts.append(Layout.create(LayoutSpec(world_size=4, tp=2), timeout=timeout, registry=registry))
    first, second = layouts
    return dict(first=_sums(first, ("tp", "dp")), second=_sums(second, ("tp", "dp", "world")))


def test_layout_after_pp4_layout_on_same_ranks():
    out = run_distributed(4, _tp2_after_pp4)
    # TP pairs [0,1] and [2,3], DP pairs [0,2] and [1,3]: sums of 2**rank over each.
    assert [o["first"] for o in out] == [[3.0, 5.0], [3.0, 10.0], [12.0, 5.0], [12.0, 10.0]]
    assert [o["second"] for o in out] == [[3.0, 5.0, 15.0], [3.0, 10.0, 15.0], [12.0, 5.0, 15.0],
                                          [12.0, 10.0, 15.0]]


def _layout_after_pair_group() -> list[float]:
    timeout = datetime.timedelta(seconds=DIVERGED_TIMEOUT_S)
    registry = GroupRegistry()
    if dist.get_rank() in (0, 3):
        registry.get([3, 0], timeout)  # ranks 1, 2 make nothing
    layout = Layout.create(LayoutSpec(world_size=4, pp=2), timeout=timeout, registry=registry)
    return _sums(layout, ("dp", "pp", "world"))


def test_layout_after_some_ranks_made_a_group():
    out = run_distributed(4, _layout_after_pair_group)
    # PP2 over 4 ranks: DP pairs [0,1] and [2,3], PP pairs [0,2] and [1,3]; each has one member that made [0,3].
    assert out == [[3.0, 5.0, 15.0], [3.0, 10.0, 15.0], [12.0, 5.0, 15.0], [12.0, 10.0, 15.0]]


def _group_with_absent_member() -> str:
    if dist.get_rank() == 2:
        return "absent"  # never starts making the group over [0, 1, 2]
    try:
        GroupRegistry().get([0, 1, 2], datetime.timedelta(seconds=2))
    except TimeoutError as exc:
        return str(exc)
    return "made"


def test_group_creation_names_members_that_never_came():
    out = run_distributed(3, _group_with_absent_member)
    assert out[2] == "absent"
    for message in out[:2]:
        assert message.startswith("group over ranks [0, 1, 2]: ranks [2] did not start making it within 0:00:02")
