"""The controller's detached placement: one worker group over a trainer pool and a rollout pool is ONE
torch.distributed world (trainer ranks first); roles live on rank subsets and dispatch by their own layout over their
own ranks; PER_REPLICA hands each DP replica its own arguments; a role that fails while being built is reported at
once, although another role's ranks wait for it in a collective."""

import os
import sys

import pytest
import ray
import ray.cloudpickle
import torch
import torch.distributed as dist

from shardrl.controller.cluster import init_ray
from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.controller.group import Role, WorkerError, WorkerGroup
from shardrl.controller.pool import ResourcePool
from shardrl.controller.dispatch import DispatchError, route
from shardrl.data.batch import Batch
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec

pytestmark = pytest.mark.timeout(180)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import test modules


class Probe:
    """Builds its layout over its own ranks; `world_sum` is a collective over every rank of both pools."""

    def __init__(self, spec: LayoutSpec, ranks: list[int], registry: GroupRegistry,
                 fail_on_rank: int | None = None) -> None:
        if dist.get_rank() == fail_on_rank:
            raise ValueError(f"refusing to start on rank {fail_on_rank}")
        self.layout = Layout.create(spec, ranks, registry=registry)
        dist.barrier()  # the whole world: a rank that failed above leaves the others waiting here

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value)
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "env_rank": os.environ["RANK"],
                "layout_ranks": self.layout.ranks, "tp_rank": self.layout.tp_rank, "sum": value.item()}

    @dispatch_mode(Dispatch.PER_REPLICA)
    def echo(self, value: int, scale: int) -> tuple[int, int, int]:
        return dist.get_rank(), self.layout.tp_rank, value * scale

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def shifted(self, batch: Batch) -> Batch:
        return Batch({"y": batch.tensors["x"] + 100 * dist.get_rank()})


@pytest.fixture(scope="module")
def ray_session():
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def two_pools() -> list[ResourcePool]:
    return [ResourcePool("trainer", 1, 2, "cpu"), ResourcePool("rollout", 1, 2, "cpu")]


def roles(fail_on_rank: int | None = None) -> list[Role]:
    trainer, rollout = LayoutSpec(2, tp=2), LayoutSpec(2)
    return [Role("actor", Probe, {"spec": trainer, "ranks": [0, 1], "fail_on_rank": fail_on_rank}, trainer,
                 ranks=[0, 1]),
            Role("rollout", Probe, {"spec": rollout, "ranks": [2, 3], "fail_on_rank": fail_on_rank}, rollout,
                 ranks=[2, 3])]


def test_two_pools_one_world_roles_on_their_own_ranks(ray_session):
    pools = two_pools()
    group = WorkerGroup(pools, roles())
    try:
        actor, rollout = group.role("actor"), group.role("rollout")
        pending = [actor.submit(Probe.where), rollout.submit(Probe.where)]  # the all-reduce needs both pools at once
        trainer_ranks, rollout_ranks = (p.get() for p in pending)
        assert [(r["rank"], r["env_rank"], r["world"]) for r in trainer_ranks + rollout_ranks] == [
            (0, "0", 4), (1, "1", 4), (2, "2", 4), (3, "3", 4)]
        assert [r["layout_ranks"] for r in trainer_ranks + rollout_ranks] == [[0, 1]] * 2 + [[2, 3]] * 2
        assert {r["sum"] for r in trainer_ranks + rollout_ranks} == {10.0}  # 1 + 2 + 3 + 4
        assert (actor.layout.dp, rollout.layout.dp) == (1, 2)

        # PER_REPLICA: the rollout's two replicas get one value each; the trainer's one TP2 replica answers once.
        assert rollout.call(Probe.echo, [10, 20], [1, 2]) == [(2, 0, 10), (3, 0, 40)]
        assert actor.call(Probe.echo, [5], [3]) == [(0, 0, 15)]
        # DP_COMPUTE over the rollout's own ranks: rows 0-1 to global rank 2, rows 2-3 to rank 3.
        out = rollout.call(Probe.shifted, Batch({"x": torch.arange(4)}))
        assert out.tensors["y"].tolist() == [200, 201, 302, 303]
    finally:
        group.shutdown()
        for pool in pools:
            pool.release()


def test_a_role_failing_while_built_is_reported_not_waited_for(ray_session):
    pools = two_pools()
    try:
        with pytest.raises(WorkerError, match=r"worker group 'trainer\+rollout', role 'rollout', 'add_role': rank 2 "
                                              r"on [\w.:-]+ raised ValueError: refusing to start on rank 2"):
            WorkerGroup(pools, roles(fail_on_rank=2))
    finally:
        for pool in pools:
            pool.release()


def test_per_replica_routing_and_errors():
    spec = LayoutSpec(4, tp=2)  # ranks (dp, tp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1)
    routing = route(Dispatch.PER_REPLICA, spec, (["a", "b"],), {"k": [1, 2]})
    assert routing.payload_of_rank == [0, 0, 1, 1] and routing.reporting_ranks == [0, 2]
    assert routing.payloads == [(("a",), {"k": 1}), (("b",), {"k": 2})]
    assert routing.collect({0: "first", 2: "second"}) == ["first", "second"]
    with pytest.raises(DispatchError, match=r"PER_REPLICA: keyword 'k' must be a list with one value per DP replica "
                                            r"\(2\), got 3"):
        route(Dispatch.PER_REPLICA, spec, (), {"k": [1, 2, 3]})
