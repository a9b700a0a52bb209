"""Dispatch routing without Ray: which rank gets which chunk, who reports, how results merge."""

import pytest
import torch

from shardrl.controller.dispatch import Dispatch, DispatchError, output_owner, route
from shardrl.data.batch import NUM_PAD_KEY, Batch
from shardrl.parallel.layout_spec import LayoutSpec


def _batch(n: int) -> Batch:
    return Batch({"x": torch.arange(n)}, {"uid": [f"s{i}" for i in range(n)]})


def _run(routing, worker) -> object:
    """Play the ranks: call `worker(rank, *args, **kwargs)` with each rank's payload, collect the reporters."""
    by_rank = {}
    for rank, index in enumerate(routing.payload_of_rank):
        args, kwargs = routing.payloads[index]
        out = worker(rank, *args, **kwargs)
        if rank in routing.reporting_ranks:
            by_rank[rank] = out
    return routing.collect(by_rank)


def test_one_to_all_and_all_to_all():
    spec = LayoutSpec(3)
    routing = route(Dispatch.ONE_TO_ALL, spec, (5,), {"k": 2})
    assert _run(routing, lambda rank, a, k: a * k + rank) == [10, 11, 12]
    routing = route(Dispatch.ALL_TO_ALL, spec, ([1, 2, 3],), {"k": [10, 20, 30]})
    assert _run(routing, lambda rank, a, k: (rank, a, k)) == [(0, 1, 10), (1, 2, 20), (2, 3, 30)]
    with pytest.raises(DispatchError, match="argument 0 must be a list with one value per rank \\(3\\), got 2"):
        route(Dispatch.ALL_TO_ALL, spec, ([1, 2],), {})


def test_dp_compute_tp2_dp2_pads_routes_and_unpads():
    spec = LayoutSpec(4, tp=2)  # ranks (dp, tp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1)
    routing = route(Dispatch.DP_COMPUTE, spec, (_batch(5),), {"scale": 10})
    assert routing.payload_of_rank == [0, 0, 1, 1]
    assert routing.reporting_ranks == [0, 2]
    chunks = [p[0][0] for p in routing.payloads]
    assert [c.tensors["x"].tolist() for c in chunks] == [[0, 1, 2], [3, 4, 0]]  # padded with a copy of row 0
    assert [c.meta.get(NUM_PAD_KEY, 0) for c in chunks] == [0, 1]

    def worker(rank, batch, scale):
        dp = spec.coords(rank)["dp"]
        y = batch.tensors["x"] * scale + dp
        return Batch({"y": y}, {"uid": batch.non_tensors["uid"]}, dict(batch.meta))

    out = _run(routing, worker)
    assert out.tensors["y"].tolist() == [0, 10, 20, 31, 41]
    assert list(out.non_tensors["uid"]) == ["s0", "s1", "s2", "s3", "s4"]
    assert NUM_PAD_KEY not in out.meta


def test_dp_compute_owner_is_last_stage_tp0_cp0():
    spec = LayoutSpec(8, tp=2, pp=2)  # dp=2; dense order ((pp*DP + dp)*CP + cp)*TP + tp
    assert [r for r in range(8) if output_owner(spec, r)] == [4, 6]
    spec = LayoutSpec(8, tp=2, cp=2)  # dp=2
    assert [r for r in range(8) if output_owner(spec, r)] == [0, 4]
    routing = route(Dispatch.DP_COMPUTE, LayoutSpec(4, pp=2), (_batch(4),), {})
    assert routing.reporting_ranks == [2, 3] and routing.payload_of_rank == [0, 1, 0, 1]
    assert _run(routing, lambda rank, b: {"rank": rank, "rows": len(b)}) == [{"rank": 2, "rows": 2},
                                                                              {"rank": 3, "rows": 2}]


def test_dp_compute_errors():
    spec = LayoutSpec(2)
    with pytest.raises(DispatchError, match="lengths"):
        route(Dispatch.DP_COMPUTE, spec, (3,), {})
    with pytest.raises(DispatchError, match="lengths \\{2, 3\\}"):
        route(Dispatch.DP_COMPUTE, spec, (_batch(2), _batch(3)), {})
    with pytest.raises(DispatchError, match="unpad"):
        route(Dispatch.DP_COMPUTE, spec, (_batch(3).pad_to_divisor(2),), {})
    routing = route(Dispatch.DP_COMPUTE, spec, (_batch(4),), {})
    with pytest.raises(DispatchError, match="rank 1 returned 1 rows for a chunk of 2"):
        _run(routing, lambda rank, b: b.take([0]) if rank == 1 else b)
