"""The worker group's collective timeout reaches the ranks' process groups: a collective that one rank never joins
fails the call with a WorkerError that says it timed out, long before the call's own deadline. Checked on the default
group (made when a rank joins) and on a group of a role's layout (built as the workers build theirs)."""

import datetime
import sys
import time

import pytest
import ray
import ray.cloudpickle
import torch
import torch.distributed as dist

from shardrl.controller.cluster import init_ray
from shardrl.controller.dispatch import Dispatch
from shardrl.controller.group import Role, WorkerError, WorkerGroup
from shardrl.controller.rank_env import collective_timeout
from shardrl.controller.pool import ResourcePool
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec

pytestmark = pytest.mark.timeout(120)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import a test module

TIMEOUT = datetime.timedelta(seconds=5)
CALL_TIMEOUT_S = 120.0


class LonelyCollective:
    """A role whose layout is built with the group's collective timeout, as the real workers build theirs."""

    def __init__(self, registry: GroupRegistry) -> None:
        self.layout = Layout.create(LayoutSpec(2), timeout=collective_timeout(), registry=registry)

    def timeout_seen(self) -> float:
        return collective_timeout().total_seconds()

    def all_reduce_alone(self, group: str) -> float:
        """Rank 0 all-reduces over `group` ("default" or a layout group); rank 1 returns at once, never joining."""
        value = torch.ones(1)
        if dist.get_rank() == 0:
            dist.all_reduce(value, group=None if group == "default" else self.layout.group(group))
        return value.item()


@pytest.fixture(scope="module")
def ray_session():
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.mark.parametrize("group", ["default", "world"])
def test_a_collective_one_rank_never_joins_times_out(ray_session, group):
    pool = ResourcePool(f"lonely_{group}", 1, 2, "cpu")
    workers = WorkerGroup(pool, [Role("actor", LonelyCollective)], collective_timeout=TIMEOUT,
                          call_timeout_s=CALL_TIMEOUT_S)
    try:
        assert workers.call("actor", "timeout_seen", Dispatch.ONE_TO_ALL) == [5.0, 5.0]
        start = time.monotonic()
        # gloo's words, with the group's 5 s in them.
        with pytest.raises(WorkerError, match=r"role 'actor', 'all_reduce_alone': rank 0 on [\w.:-]+ raised "
                                              r"RuntimeError: "
                                              r".*Timed out waiting 5000ms") as info:
            workers.call("actor", "all_reduce_alone", Dispatch.ONE_TO_ALL, group)
        elapsed = time.monotonic() - start
        assert info.value.rank == 0
        assert TIMEOUT.total_seconds() <= elapsed < 30, f"failed after {elapsed:.1f} s"
    finally:
        workers.shutdown()
        pool.release()
