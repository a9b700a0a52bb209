"""MoE layer over EP / ETP / TP-folded layouts on gloo against the single-process per-token reference.

Every rank owns different tokens (one rank owns none); outputs, input gradients and all weight gradients (shards put
back into full tensors by their specs, summed over ranks) must equal the reference's, router losses included.
"""

import torch
import torch.distributed as dist

from shardrl.parallel.expert import MoELayer, RouterOptions
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from test_expert import ATOL, NAMES, full_weights, load_full, reference_moe, reference_router_losses

H, F_SIZE, E, K = 16, 8, 8, 2
AUX_COEF, Z_COEF = 0.1, 0.01
SEED = 11


def global_batch(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and the upstream gradient of the layer output, identical on every rank."""
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(num_tokens, H, generator=g), torch.randn(num_tokens, H, generator=g)


def _run_layouts(layouts: dict[str, dict], tokens_per_rank: list[int]) -> dict[str, dict]:
    rank = dist.get_rank()
    x_all, grad_all = global_batch(sum(tokens_per_rank))
    start, n = sum(tokens_per_rank[:rank]), tokens_per_rank[rank]
    results, registry = {}, GroupRegistry()  # one per process: every layout's groups from it
    for name, sizes in layouts.items():
        layout = Layout.create(LayoutSpec(world_size=dist.get_world_size(), **sizes), registry=registry)
        layer = MoELayer(H, F_SIZE, E, K, layout, NAMES, norm_topk_prob=True,
                         router=RouterOptions(aux_loss_coef=AUX_COEF, z_loss_coef=Z_COEF))
        load_full(layer, full_weights(SEED, H, F_SIZE, E))
        tp = layout.tp_size  # a TP group's ranks hold one micro batch, split: the router losses cover all of it
        group = tokens_per_rank[rank // tp * tp:(rank // tp + 1) * tp]
        layer.aux_loss_scale = sum(group) / len(x_all)  # token-weighted mean over the micro batches
        x = x_all[start:start + n].to(layout.device).requires_grad_()
        out = layer(x)
        (out * grad_all[start:start + n].to(layout.device)).sum().backward()
        params = dict(router=layer.router.weight, gate=layer.w_gate, up=layer.w_up, down=layer.w_down)
        results[name] = dict(out=out.detach().cpu(), x_grad=x.grad.cpu(), aux=layer.last_aux_loss.item(),
                             z=layer.last_z_loss.item(),
                             grads={k: (p.grad.cpu(), p.shard_spec) for k, p in params.items()})
    return results


def _reference(tokens_per_rank: list[int], tp: int) -> dict:
    """Full-model reference; each group of `tp` consecutive ranks holds one micro batch for the router losses."""
    w = {k: v.requires_grad_() for k, v in full_weights(SEED, H, F_SIZE, E).items()}
    x_all, grad_all = global_batch(sum(tokens_per_rank))
    x = x_all.clone().requires_grad_()
    out = reference_moe(x, w, K, norm_topk=True)
    loss = (out * grad_all).sum()
    micro_batches = [sum(tokens_per_rank[i:i + tp]) for i in range(0, len(tokens_per_rank), tp)]
    router_losses = []
    for piece in x.split(micro_batches):
        aux, z = reference_router_losses(piece, w["router"], K) if len(piece) else (torch.zeros(()),) * 2
        router_losses.append((aux.item(), z.item()))
        loss = loss + len(piece) / len(x) * (AUX_COEF * aux + Z_COEF * z)
    loss.backward()
    return dict(out=out.detach(), x_grad=x.grad, router_losses=router_losses, **{k: v.grad for k, v in w.items()})


def _full_grads(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Sum every rank's gradient shard into the full tensor at the place its spec names."""
    full = {k: torch.zeros_like(v) for k, v in full_weights(SEED, H, F_SIZE, E).items()}
    for result in ranks:
        for key, (grad, spec) in result["grads"].items():
            if spec.expert_ids is None:
                full[key] += grad
                continue
            lo, hi = spec.slice_range()
            for i, e in enumerate(spec.expert_ids):
                full[key][e].narrow(spec.dim, lo, hi - lo).add_(grad[i])
    return full


def check_layouts(layouts: dict[str, dict], tokens_per_rank: list[int], backend: str = "gloo") -> list[dict]:
    """Run the layouts, compare each with the reference; return the per-rank results."""
    # Uneven splits with empty sends: some rank has too few tokens to route to every expert.
    assert min(tokens_per_rank) * K < E
    per_rank = run_distributed(len(tokens_per_rank), _run_layouts, layouts, tokens_per_rank, backend=backend)
    for name, sizes in layouts.items():
        tp = sizes.get("tp", 1)
        ref = _reference(tokens_per_rank, tp)
        ref_out, ref_x_grad = ref["out"].split(tokens_per_rank), ref["x_grad"].split(tokens_per_rank)
        ranks = [r[name] for r in per_rank]
        for rank, result in enumerate(ranks):
            torch.testing.assert_close(result["out"], ref_out[rank], **ATOL, msg=f"{name} rank {rank} output")
            torch.testing.assert_close(result["x_grad"], ref_x_grad[rank], **ATOL, msg=f"{name} rank {rank} dx")
            aux, z = ref["router_losses"][rank // tp]
            assert abs(result["aux"] - aux) < 1e-5 and abs(result["z"] - z) < 1e-5, (name, rank)
        for key, grad in _full_grads(ranks).items():
            torch.testing.assert_close(grad, ref[key], **ATOL, msg=f"{name} grad of {key}")
    return per_rank


def test_ep2_etp2_tp2xep2_on_two_ranks():
    check_layouts({"ep2": dict(ep=2), "etp2": dict(etp=2), "tp2xep2": dict(tp=2, ep=2)}, tokens_per_rank=[7, 3])


def test_four_rank_layouts_and_their_specs():
    layouts = {"ep4": dict(ep=4), "ep2xetp2": dict(ep=2, etp=2), "tp2xep2": dict(tp=2, ep=2),
               "tp2xep2xetp2": dict(tp=2, ep=2, etp=2)}
    per_rank = check_layouts(layouts, tokens_per_rank=[6, 0, 9, 4])
    specs = [{k: spec for k, (_, spec) in r["tp2xep2xetp2"]["grads"].items()} for r in per_rank]
    # Rank order for experts is (ep * ETP + etp): ranks 0,1 hold experts 0..3, ranks 2,3 experts 4..7.
    assert [s["gate"].expert_ids for s in specs] == [(0, 1, 2, 3)] * 2 + [(4, 5, 6, 7)] * 2
    assert [s["gate"].slice_range() for s in specs] == [(0, 4), (4, 8)] * 2
    assert [s["down"].slice_range() for s in specs] == [(0, 4), (4, 8)] * 2
    assert all(s["down"].dim == 1 and s["gate"].group == "etp" for s in specs)
    assert all(s["router"].sum_grad_over_group and s["router"].dim is None for s in specs)
    assert specs[2]["up"].hf_names()[0] == "model.layers.0.mlp.experts.4.up_proj.weight"


def _within_tp(num_tokens: int) -> dict:
    """TP2 with the experts split over it (EP 1, ETP 2: the rollout's default) and this rank's share of the tokens
    (`token_split_sizes`): the layer's output and gradients with `num_tokens` (the dispatch plan made on the host)
    and without (the plan learned from the device), and the host reads of each forward (grouped expert GEMMs)."""
    from unittest import mock

    from shardrl.parallel.tensor import token_split_sizes
    from test_host_reads import HostReads

    rank = dist.get_rank()
    layout = Layout.create(LayoutSpec(world_size=2, tp=2, etp=2))
    layer = MoELayer(H, F_SIZE, E, K, layout, NAMES, norm_topk_prob=True)
    load_full(layer, full_weights(SEED, H, F_SIZE, E))
    x_all, grad_all = global_batch(num_tokens)
    start = sum(token_split_sizes(num_tokens, 2)[:rank])
    piece = slice(start, start + token_split_sizes(num_tokens, 2)[rank])
    result = {}
    for name, tokens in (("host_plan", num_tokens), ("device_plan", None)):
        x = x_all[piece].clone().requires_grad_()
        out = layer(x, tokens)
        (out * grad_all[piece]).sum().backward()
        result[name] = (out.detach(), x.grad, layer.w_gate.grad.clone())
        layer.zero_grad()
        counter = HostReads([p for p in layer.parameters()])
        with (mock.patch("shardrl.parallel.grouped_gemm.can_use_grouped_mm", return_value=True), counter,
              counter.wrap("tolist"), counter.wrap("cpu"), counter.wrap("numpy"), torch.no_grad()):
            layer(x_all[piece], tokens)
        result[name + "_reads"] = counter.sites
    return result


def test_dispatch_inside_the_tp_group_reads_nothing_from_the_device():
    """With the tokens' split known on the host the plan needs no device read, so a CUDA graph can hold the layer
    (MoE rollout decode); its outputs and gradients equal the device-learned plan's and the per-token reference."""
    num_tokens = 5  # split 3 + 2 over TP2
    ranks = run_distributed(2, _within_tp, num_tokens)
    w = full_weights(SEED, H, F_SIZE, E)
    x_all, _ = global_batch(num_tokens)
    expected = reference_moe(x_all, w, K, norm_topk=True).detach()
    outs = {name: torch.cat([r[name][0] for r in ranks]) for name in ("host_plan", "device_plan")}
    torch.testing.assert_close(outs["host_plan"], expected, **ATOL)
    assert torch.equal(outs["host_plan"], outs["device_plan"])
    for r in ranks:
        assert all(torch.equal(h, d) for h, d in zip(r["host_plan"][1:], r["device_plan"][1:]))  # x, w_gate grads
        assert r["host_plan_reads"] == [], r["host_plan_reads"]
        assert r["device_plan_reads"], "the device-learned plan reads its split sizes (the test can see reads)"
