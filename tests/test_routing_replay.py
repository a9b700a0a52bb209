"""MoE routing record and replay (parallel/routing.py), the base of R2/R3 routing replay: a recording forward writes
each token's own top-k experts; a replaying one runs each token through the table's experts, weighed by its own
router's probabilities (so the router still learns). Checked against a token-by-token reference at one process and
over EP2, EP2 x ETP2 and experts split over TP on gloo; a replay misaligned by one token is told apart."""

import torch
import torch.distributed as dist

from shardrl.parallel.expert import MoELayer, attached
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.routing import RoutingTable, expert_id_dtype
from test_expert import ATOL, NAMES, full_weights, load_full, reference_moe

H, F_SIZE, E, K = 16, 8, 8, 2
SEED, LAYER = 5, 3
TOKENS_PER_RANK = [5, 3, 0, 6]


def reference_routed(x, w, experts, norm_topk: bool):
    """Token by token: token t through experts[t], weighed by its router probabilities of them."""
    return reference_moe(x, w, K, norm_topk, experts)


def own_top_k(x, router):
    probs = torch.softmax(x @ router.T, dim=-1)
    return torch.tensor([sorted(range(E), key=lambda e: -row[e].item())[:K] for row in probs])


def tokens(n: int) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(SEED + 1))


def other_experts(own: torch.Tensor) -> torch.Tensor:
    """Experts no token chose itself (each one's choice shifted by 3 experts): what a replay must follow."""
    return (own + 3) % E


def one_layer(layout) -> MoELayer:
    layer = MoELayer(H, F_SIZE, E, K, layout, NAMES, norm_topk_prob=True, layer_id=LAYER)
    load_full(layer, full_weights(SEED, H, F_SIZE, E))
    return layer


def test_recording_writes_each_tokens_own_top_k_and_replay_follows_the_table():
    w = {k: v.requires_grad_() for k, v in full_weights(SEED, H, F_SIZE, E).items()}
    x = tokens(9)
    layer = one_layer(Layout.create(LayoutSpec(world_size=1)))
    with attached(layer, RoutingTable.recording(9, [1, LAYER], K, x.device)) as table:
        layer(x)
    own = own_top_k(x, w["router"].detach())
    assert torch.equal(table.experts[:, 1].sort(-1).values, own.sort(-1).values)
    assert not table.experts[:, 0].any()  # another layer's column stays untouched

    replayed = other_experts(own)
    xr = x.clone().requires_grad_()
    with attached(layer, RoutingTable(replayed.to(expert_id_dtype(E))[:, None], [LAYER], replay=True)):
        out = layer(xr)
    assert layer.routing is None  # detached after the body
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * upstream).sum().backward()
    xref = x.clone().requires_grad_()
    expected = reference_routed(xref, w, replayed, norm_topk=True)
    (expected * upstream).sum().backward()
    torch.testing.assert_close(out, expected, **ATOL)
    torch.testing.assert_close(xr.grad, xref.grad, **ATOL)
    # the router still learns: its gradient through the replayed experts' probabilities
    torch.testing.assert_close(layer.router.weight.grad, w["router"].grad, **ATOL)
    assert layer.router.weight.grad.abs().sum() > 0

    # A table one token off is told apart from the right one.
    shifted = torch.roll(replayed, 1, dims=0)
    with attached(layer, RoutingTable(shifted[:, None], [LAYER], replay=True)), torch.no_grad():
        off = layer(x)
    assert not torch.allclose(off, expected.detach(), **ATOL)


def test_expert_id_dtype_is_the_smallest_that_holds_the_experts():
    assert [expert_id_dtype(n) for n in (8, 255, 256, 32767, 32768)] == [
        torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int32]


def _record_and_replay(layouts: dict[str, dict]) -> dict[str, tuple]:
    rank = dist.get_rank()
    x_all = tokens(sum(TOKENS_PER_RANK))
    start, n = sum(TOKENS_PER_RANK[:rank]), TOKENS_PER_RANK[rank]
    own = own_top_k(x_all, full_weights(SEED, H, F_SIZE, E)["router"])
    registry, results = GroupRegistry(), {}
    for name, sizes in layouts.items():
        layer = one_layer(Layout.create(LayoutSpec(world_size=dist.get_world_size(), **sizes), registry=registry))
        x = x_all[start:start + n]
        with attached(layer, RoutingTable.recording(n, [LAYER], K, x.device)) as table, torch.no_grad():
            layer(x)
        replayed = other_experts(own)[start:start + n]
        with attached(layer, RoutingTable(replayed[:, None], [LAYER], replay=True)), torch.no_grad():
            out = layer(x)
        results[name] = (table.experts[:, 0].sort(-1).values, out)
    return results


def test_record_and_replay_over_expert_parallel_layouts_match_one_process():
    layouts = {"ep2": dict(ep=2), "ep2_etp2": dict(ep=2, etp=2), "experts_over_tp2": dict(tp=2, etp=2)}
    ranks = run_distributed(4, _record_and_replay, layouts)
    w = full_weights(SEED, H, F_SIZE, E)
    x_all = tokens(sum(TOKENS_PER_RANK))
    own = own_top_k(x_all, w["router"])
    expected = reference_routed(x_all, w, other_experts(own), norm_topk=True)
    for name in layouts:
        recorded = torch.cat([r[name][0] for r in ranks])
        assert torch.equal(recorded, own.sort(-1).values), name
        torch.testing.assert_close(torch.cat([r[name][1] for r in ranks]), expected, **ATOL, msg=name)
