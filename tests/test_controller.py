"""The Ray controller end to end on CPU: rendezvous, dispatch over a TP2xDP2 layout, colocated roles, several pools,
and failures that must surface (with role and rank) instead of hanging.

One Ray instance and one 4-rank group serve the whole module: starting Ray and the rank processes is the slow part.
"""

import os
import sys
import time

import pytest
import ray
import ray.cloudpickle
import torch
import torch.distributed as dist

from shardrl.controller.cluster import init_ray
from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.controller.group import Role, WorkerError, WorkerGroup
from shardrl.controller.pool import ResourcePool, ResourcePoolError
from shardrl.data.batch import NUM_PAD_KEY, Batch
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec

pytestmark = pytest.mark.timeout(120)

# Ray's workers cannot import a test module (pytest puts tests/ on the path of this process only): ship the test
# worker classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ProbeWorker:
    """A role that reports what its rank sees; its layout is handed in, as real workers get theirs from config."""

    def __init__(self, layout: LayoutSpec, registry: GroupRegistry) -> None:
        self.layout = Layout.create(layout, registry=registry)
        self.seen: list[int] = []
        self.seen_pad = 0

    def env_and_sum(self) -> dict:
        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value)
        env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        return {"env": env, "rank": dist.get_rank(), "world": dist.get_world_size(), "sum": value.item(),
                "pid": os.getpid()}

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def scale(self, batch: Batch, factor: int) -> Batch:
        self.seen = batch.tensors["x"].tolist()
        self.seen_pad = batch.meta.get(NUM_PAD_KEY, 0)
        # Non-owner TP ranks would add 1000 per TP rank: the collected result must show none of it.
        y = batch.tensors["x"] * factor + self.layout.dp_rank + 1000 * self.layout.tp_rank
        return Batch({"y": y}, {"uid": batch.non_tensors["uid"]})

    def last_seen(self) -> tuple[list[int], int]:
        return self.seen, self.seen_pad

    def plus_rank(self, value: int) -> int:
        return value + dist.get_rank()


class RefWorker:
    """A second role colocated with ProbeWorker: same process, same default group, same registry, its own (pure DP)
    layout."""

    def __init__(self, layout: LayoutSpec, registry: GroupRegistry) -> None:
        self.layout = Layout.create(layout, registry=registry)

    def dp_sum(self, value: float) -> dict:
        total = torch.tensor([value])
        dist.all_reduce(total, group=self.layout.dp_group)
        return {"sum": total.item(), "pid": os.getpid(), "dp_size": self.layout.dp_size,
                "rank_sets": self.layout.registry.rank_sets()}

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def double(self, batch: Batch) -> Batch:
        return Batch({"y": batch.tensors["x"] * 2 + 100 * self.layout.dp_rank})


class FailingWorker:
    def __init__(self, registry: GroupRegistry) -> None:
        """Builds no layout, so it has no use for the process's registry."""

    def crash(self, bad_rank: int) -> int:
        """`bad_rank` dies; the others wait in a collective that can never complete."""
        if dist.get_rank() == bad_rank:
            os._exit(1)
        dist.barrier()
        return dist.get_rank()

    def refuse(self, bad_rank: int) -> int:
        if dist.get_rank() == bad_rank:
            raise ValueError(f"refusing input on purpose (rank {bad_rank})")
        return dist.get_rank()

    def hang(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.fixture(scope="module")
def ray_session():
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def world4(ray_session):
    pool = ResourcePool("trainer", nnodes=1, n_per_node=4, device="cpu")
    group = WorkerGroup(pool, [Role("actor", ProbeWorker, {"layout": LayoutSpec(4, tp=2)}, LayoutSpec(4, tp=2)),
                               Role("ref", RefWorker, {"layout": LayoutSpec(4)})])
    yield group
    group.shutdown()
    pool.release()


def test_rendezvous_env_and_all_reduce(world4):
    out = world4.call("actor", "env_and_sum", Dispatch.ONE_TO_ALL)
    assert [o["env"] for o in out] == [{"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r)} for r in range(4)]
    assert [(o["rank"], o["world"]) for o in out] == [(r, 4) for r in range(4)]
    assert [o["sum"] for o in out] == [10.0] * 4  # 1 + 2 + 3 + 4
    assert len({o["pid"] for o in out}) == 4
    assert world4.call("actor", "plus_rank", Dispatch.ALL_TO_ALL, [10, 20, 30, 40]) == [10, 21, 32, 43]


def test_dp_compute_tp2_dp2(world4):
    batch = Batch({"x": torch.arange(5)}, {"uid": ["a", "b", "c", "d", "e"]})
    out = world4.role("actor").call(ProbeWorker.scale, batch, factor=10)
    assert out.tensors["y"].tolist() == [0, 10, 20, 31, 41]  # x * 10 + dp rank, from TP rank 0 only
    assert list(out.non_tensors["uid"]) == ["a", "b", "c", "d", "e"]
    # Both TP ranks of a replica got the replica's chunk; the padding row (a copy of row 0) is flagged.
    seen = world4.call("actor", "last_seen", Dispatch.ONE_TO_ALL)
    assert seen == [([0, 1, 2], 0), ([0, 1, 2], 0), ([3, 4, 0], 1), ([3, 4, 0], 1)]


def test_colocated_roles_share_process_and_group(world4):
    actor = world4.call("actor", "env_and_sum", Dispatch.ONE_TO_ALL)
    ref = world4.call("ref", "dp_sum", Dispatch.ONE_TO_ALL, 0.5)
    assert [r["pid"] for r in ref] == [a["pid"] for a in actor]
    assert [(r["sum"], r["dp_size"]) for r in ref] == [(2.0, 4)] * 4
    # One registry per process: the ref role's DP4 group is the actor's world group (made once, by the actor), and
    # the registry holds the actor's TP and DP groups too.
    assert [r["rank_sets"] for r in ref] == [[(0, 1), (0, 2), (0, 1, 2, 3)], [(0, 1), (1, 3), (0, 1, 2, 3)],
                                             [(2, 3), (0, 2), (0, 1, 2, 3)], [(2, 3), (1, 3), (0, 1, 2, 3)]]
    # Each role dispatches by its own layout: the ref role is DP4, so 5 rows pad to 8 and split 2 per rank.
    out = world4.role("ref").call(RefWorker.double, Batch({"x": torch.arange(5)}))
    assert out.tensors["y"].tolist() == [0, 2, 104, 106, 208]
    with pytest.raises(ValueError, match=r"ProbeWorker.plus_rank has no @dispatch_mode"):
        world4.role("actor").call(ProbeWorker.plus_rank, 1)
    with pytest.raises(ValueError, match=r"is not a method of ProbeWorker"):  # another role's worker method
        world4.role("actor").call(RefWorker.double, Batch({"x": torch.arange(5)}))


def test_two_pools_coexist_and_fail_alone(world4):
    pools = [ResourcePool("train2", 1, 2, "cpu"), ResourcePool("rollout1", 1, 1, "cpu")]
    groups = [WorkerGroup(p, [Role("probe", ProbeWorker, {"layout": LayoutSpec(p.world_size)}),
                              Role("critic", FailingWorker)]) for p in pools]
    try:
        pending = [g.submit("probe", "env_and_sum", Dispatch.ONE_TO_ALL) for g in groups]  # both pools at once
        assert [[o["sum"] for o in p.get()] for p in pending] == [[3.0, 3.0], [1.0]]
        calls = [(world4, "actor"), (groups[0], "probe"), (groups[1], "probe")]
        pids = [o["pid"] for g, role in calls for o in g.call(role, "env_and_sum", Dispatch.ONE_TO_ALL)]
        assert len(set(pids)) == 7  # every rank of every group is its own process

        # A worker's exception names role, method, rank and message, and stops only its own group.
        with pytest.raises(WorkerError, match=r"worker group 'train2', role 'critic', 'refuse': rank 1 on [\w.:-]+ "
                                              r"raised "
                                              r"ValueError: refusing input on purpose \(rank 1\)") as info:
            groups[0].call("critic", "refuse", Dispatch.ONE_TO_ALL, 1)
        assert (info.value.role, info.value.rank, info.value.method) == ("critic", 1, "refuse")
        with pytest.raises(WorkerError, match="'train2' is stopped"):
            groups[0].call("probe", "env_and_sum", Dispatch.ONE_TO_ALL)
        assert [o["sum"] for o in groups[1].call("probe", "env_and_sum", Dispatch.ONE_TO_ALL)] == [1.0]
    finally:
        for g, p in zip(groups, pools):
            g.shutdown()
            p.release()


@pytest.mark.timeout(60)
def test_worker_death_names_role_and_rank(ray_session):
    pool = ResourcePool("crashy", 1, 2, "cpu")
    group = WorkerGroup(pool, [Role("actor", FailingWorker)])
    try:
        with pytest.raises(WorkerError, match=r"role 'actor', 'crash': rank 1 on [\w.:-]+ died") as info:
            group.call("actor", "crash", Dispatch.ONE_TO_ALL, 1)
        assert (info.value.role, info.value.rank) == ("actor", 1)
        assert "\n" not in str(info.value)
        with pytest.raises(WorkerError, match="is stopped"):
            group.call("actor", "refuse", Dispatch.ONE_TO_ALL, 0)
    finally:
        group.shutdown()
        pool.release()


@pytest.mark.timeout(60)
def test_hung_call_hits_the_deadline(ray_session):
    pool = ResourcePool("stuck", 1, 1, "cpu")
    group = WorkerGroup(pool, [Role("rollout", FailingWorker)])
    try:
        with pytest.raises(WorkerError, match=r"role 'rollout', 'hang': ranks \[0\] did not finish 'hang' within 1 s"):
            group.submit("rollout", "hang", Dispatch.ONE_TO_ALL, 600).get(timeout_s=1)
    finally:
        group.shutdown()
        pool.release()


def test_pool_errors(ray_session):
    with pytest.raises(ResourcePoolError, match=r"pool 'actor' needs 1 node\(s\) x 2 ranks of \(1 GPU, 1 CPU\); "
                                                r"the cluster has 0 GPU, 2 CPU") as info:
        ResourcePool("actor", 1, 2, "cuda")
    assert "\n" not in str(info.value)
    hog = ResourcePool("hog", 1, 150, "cpu")  # 1.5 of the 2 cores
    try:
        with pytest.raises(ResourcePoolError, match=r"pool 'late' needs .* only .* CPU free after 2 s"):
            ResourcePool("late", 1, 60, "cpu", ready_timeout_s=2)
    finally:
        hog.release()
