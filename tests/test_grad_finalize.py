"""Gradient finalisation and the global grad norm over TP / DP / EP / PP layouts against a single-process reference.

The toy model (also used by test_optimizer.py) has one parameter of every kind the specs describe: a sequence-
parallel norm (sum_grad_over_group), a TP-replicated norm and bias, column and row sharded weights, a KV-like weight
with fewer shards than TP ranks, experts, and a vocab-sharded embedding tied across two pipeline stages. Its
collectives are written out here (all-gather / reduce-scatter / all-reduce with their autograd duals), its loss is
a sum divided by the global token count, and the reference is plain torch on full tensors.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardrl.parallel.data import GradBuffers, sum_of_squares
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.spec import ShardSpec, get_spec, set_spec

H, F, HEADS, V, E, N = 6, 12, 4, 12, 4, 16  # hidden, ffn (HEADS heads of 3), vocab, experts, global tokens
# 100 fp32 elements: several buckets even in this toy, and (sizes not powers of two) params straddling DP chunks.
SMALL_BUCKET_MB = 100 * 4 / 2**20

LAYOUTS: dict[str, tuple[LayoutSpec, int]] = {  # name: (layout, kv heads)
    "dp2": (LayoutSpec(2), 1),
    "tp2_kv_replicated": (LayoutSpec(2, tp=2), 1),
    "tp2_dp2": (LayoutSpec(4, tp=2), 1),
    "tp4_kv2": (LayoutSpec(4, tp=4), 2),
    "ep2_edp2": (LayoutSpec(4, ep=2), 1),
    "tp2_ep2": (LayoutSpec(4, tp=2, ep=2), 1),
    "pp2_tied": (LayoutSpec(2, pp=2), 1),
    "tp2_pp2_tied": (LayoutSpec(4, tp=2, pp=2), 2),
}


class _Gather(torch.autograd.Function):
    """All-gather along dim 0; backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _ReduceScatter.apply(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    """Sum over the group and keep this rank's chunk of dim 0; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _Gather.apply(grad, ctx.group), None


class _AllReduce(torch.autograd.Function):
    """Sum of the row-parallel partial outputs; every rank's output gradient is already the full one."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _collective(fn: type[torch.autograd.Function], x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    return x if group is None else fn.apply(x, group)


def full_params(kv_heads: int, seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    full = {"sp_norm": 1 + 0.1 * torch.randn(H, generator=g), "norm": 1 + 0.1 * torch.randn(H, generator=g),
            "w1": torch.randn(F, H, generator=g), "k": torch.randn(kv_heads, H, generator=g),
            "w2": torch.randn(H, F, generator=g) / 2, "b": torch.randn(H, generator=g),
            "emb": torch.randn(V, H, generator=g)}
    full.update({f"experts.{e}.w": torch.randn(H, H, generator=g) for e in range(E)})
    return full


def batch(step: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {"x": torch.randn(N, H, generator=g), "t_a": torch.randn(N, H, generator=g),
            "t_b": torch.randn(N, H, generator=g), "t_c": torch.randn(N, V, generator=g)}


def shard_of(full: dict[str, Tensor], spec: ShardSpec) -> Tensor:
    """The slice of the full tensor(s) a spec describes (expert tensors stacked in local-expert order)."""
    if spec.expert:
        tensor = torch.stack([full[name] for name in spec.hf_names()])
    else:
        tensor = full[spec.hf_name]
    if spec.dim is None:
        return tensor
    lo, hi = spec.slice_range()
    return tensor.narrow(spec.dim + spec.expert, lo, hi - lo)


def reference_loss(full: dict[str, Tensor], data: dict[str, Tensor]) -> Tensor:
    x, kv_heads = data["x"], len(full["k"])
    h = x * full["sp_norm"]
    y = torch.relu(h @ full["w1"].T)  # [N, F]
    kv = (h @ full["k"].T)[:, torch.arange(HEADS) // (HEADS // kv_heads)]  # [N, HEADS]: each head's kv head
    z = ((y * kv.repeat_interleave(F // HEADS, dim=1)) @ full["w2"].T + full["b"]) * full["norm"]
    experts = torch.stack([torch.tanh(x[t] @ full[f"experts.{t % E}.w"].T) for t in range(N)])  # token t -> t % E
    logits = x @ full["emb"].T  # [N, V]; used by both tied copies
    return ((z * data["t_a"]).sum() + (experts * data["t_b"]).sum() + (logits * data["t_c"]).sum()
            + (torch.tanh(logits) * data["t_c"]).sum()) / N


class ToyModel(nn.Module):
    """This rank's part of the toy model. Stage 0 holds the dense TP block and the embedding, the last stage the
    experts and the tied copy of the embedding (one stage: everything, the embedding used twice)."""

    def __init__(self, layout: Layout, full: dict[str, Tensor]) -> None:
        super().__init__()
        self.layout = layout
        tp, rank, pp = layout.tp_size, layout.tp_rank, layout.spec.pp
        kv_heads = len(full["k"])
        kv_shards = min(kv_heads, tp)
        specs = [ShardSpec("emb", (V, H), dim=0, num_shards=tp, index=rank, group="tp", tied_group=pp > 1)]
        self.first, self.last = layout.is_first_stage, layout.is_last_stage
        if self.first:
            specs += [ShardSpec("sp_norm", (H,), sum_grad_over_group=tp > 1), ShardSpec("norm", (H,), group="tp"),
                      ShardSpec("w1", (F, H), dim=0, num_shards=tp, index=rank, group="tp"),
                      ShardSpec("k", (kv_heads, H), dim=0, num_shards=kv_shards, index=rank // (tp // kv_shards),
                                group="tp"),
                      ShardSpec("w2", (H, F), dim=1, num_shards=tp, index=rank, group="tp"), ShardSpec("b", (H,))]
        if self.last:
            local = E // layout.ep_size
            ids = tuple(range(layout.ep_rank * local, (layout.ep_rank + 1) * local))
            specs.append(ShardSpec("experts.{expert}.w", (H, H), group="etp", expert_ids=ids))
        for spec in specs:
            attr = spec.hf_name.split(".")[0]
            setattr(self, attr, set_spec(nn.Parameter(shard_of(full, spec).to(layout.device, copy=True)), spec))

    def loss(self, data: dict[str, Tensor]) -> Tensor:
        """This rank's share of `reference_loss` (data parallel over tokens, TP ranks split tokens for SP/experts)."""
        layout = self.layout
        data = {k: v.to(layout.device) for k, v in data.items()}
        n = N // layout.dp_size
        dp_tokens = torch.arange(layout.dp_rank * n, (layout.dp_rank + 1) * n, device=layout.device)
        m = n // layout.tp_size
        my_tokens = dp_tokens[layout.tp_rank * m:(layout.tp_rank + 1) * m]
        x = data["x"][dp_tokens]  # [n, H]
        vocab = slice(*get_spec(self.emb).slice_range())
        logits = x @ self.emb.T  # [n, V/tp]
        total = 0.0
        if self.first:
            total = self._dense(data["x"][my_tokens], data["t_a"][dp_tokens]) + (logits * data["t_c"][dp_tokens,
                                                                                                    vocab]).sum()
        if self.last:
            total = total + self._experts(data["x"][my_tokens], my_tokens, data["t_b"][my_tokens])
            total = total + (torch.tanh(logits) * data["t_c"][dp_tokens, vocab]).sum()
        return total / N

    def _dense(self, x_mine: Tensor, target: Tensor) -> Tensor:
        layout = self.layout
        h = _collective(_Gather, x_mine * self.sp_norm, layout.tp_group)  # [n, H]
        y = torch.relu(h @ self.w1.T)  # [n, F/tp]
        kv = h @ self.k.T  # [n, local kv heads]
        spec = get_spec(self.k)
        heads = torch.arange(layout.tp_rank * HEADS // layout.tp_size, (layout.tp_rank + 1) * HEADS // layout.tp_size,
                             device=layout.device)
        local_kv = heads // (HEADS // spec.full_shape[0]) - spec.index * (spec.full_shape[0] // spec.num_shards)
        y = y * kv[:, local_kv].repeat_interleave(F // HEADS, dim=1)
        # After the reduce every TP rank holds all of z and its gradient: `b` and `norm` get full gradients.
        z = (_collective(_AllReduce, y @ self.w2.T, layout.tp_group) + self.b) * self.norm  # [n, H]
        return (z * target).sum()

    def _experts(self, x_mine: Tensor, tokens: Tensor, target: Tensor) -> Tensor:
        group = self.layout.ep_group
        x_all = _collective(_Gather, x_mine, group)  # [m * ep, H]
        tokens_all = _collective(_Gather, tokens, group)
        out = torch.zeros_like(x_all)
        for i, expert in enumerate(get_spec(self.experts).expert_ids):
            routed = (tokens_all % E == expert).unsqueeze(1)
            out = out + routed * torch.tanh(x_all @ self.experts[i].T)
        return (_collective(_ReduceScatter, out, group) * target).sum()


def create_layout(spec: LayoutSpec, registry: GroupRegistry) -> Layout:
    """Over all 4 ranks, or for a 2-rank layout two instances side by side (ranks 0,1 and 2,3)."""
    if spec.world_size == dist.get_world_size():
        return Layout.create(spec, registry=registry)
    return Layout.create(spec, ranks=[0, 1] if dist.get_rank() < 2 else [2, 3], registry=registry)


def finalize_layouts(names: list[str]) -> dict[str, dict]:
    """On every rank: the finalised grads (on CPU) and the global norm of the toy model for each named layout."""
    out, registry = {}, GroupRegistry()  # one per process: every layout's groups from it
    for name in names:
        spec, kv_heads = LAYOUTS[name]
        layout = create_layout(spec, registry)
        model = ToyModel(layout, full_params(kv_heads))
        grads = GradBuffers(model.parameters(), layout, bucket_mb=SMALL_BUCKET_MB)
        for step in range(2):  # two micro batches, accumulated
            model.loss(batch(step)).backward()
        grads.finalize()
        grads_by_name = {get_spec(p).hf_name: (get_spec(p), p.main_grad.to("cpu", copy=True))
                         for p in model.parameters()}
        out[name] = dict(grads=grads_by_name, norm=grads.global_norm().item())
    return out


def reference_grads(kv_heads: int, steps: range = range(2)) -> dict[str, Tensor]:
    full = {k: v.requires_grad_() for k, v in full_params(kv_heads).items()}
    sum(reference_loss(full, batch(step)) for step in steps).backward()
    return {k: v.grad for k, v in full.items()}


def check_grads(finalized: list[dict], name: str) -> None:
    ref = reference_grads(LAYOUTS[name][1])
    for rank, result in enumerate(finalized):
        for hf_name, (spec, grad) in result[name]["grads"].items():
            torch.testing.assert_close(grad, shard_of(ref, spec), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {hf_name}: {m}")


def check_norm(finalized: list[dict], name: str) -> None:
    ref = reference_grads(LAYOUTS[name][1])
    expected = math.sqrt(sum(g.square().sum().item() for g in ref.values()))
    for result in finalized:
        assert result[name]["norm"] == pytest.approx(expected, rel=1e-6)


@pytest.fixture(scope="module")
def finalized() -> list[dict]:
    return run_distributed(4, finalize_layouts, list(LAYOUTS))


@pytest.mark.parametrize("name", LAYOUTS)
def test_finalized_grads_are_reference_slices(finalized, name):
    check_grads(finalized, name)


@pytest.mark.parametrize("name", LAYOUTS)
def test_grad_norm_counts_every_element_once(finalized, name):
    check_norm(finalized, name)


def test_sum_of_squares_over_slices_counts_every_element_once():
    # cuBLAS caps one dot at 2**31 - 1 elements; slices of 7 stand in for that bound (20 = 7 + 7 + 6).
    vector = torch.arange(1.0, 21.0)
    expected = sum(float(i) ** 2 for i in range(1, 21))  # 2870
    assert sum_of_squares(vector, max_elements=7).item() == expected
    assert sum_of_squares(vector).item() == expected
    assert sum_of_squares(torch.zeros(0)).item() == 0.0


def test_bucket_layout_hand_written():
    # 60 + 50 elements reach the bucket size (100): the bucket closes, padded to 128 (ALIGN 64 x dp 1); 7 start
    # the next. The 2-D param goes to its own (weight-decay) buffer.
    params = [set_spec(nn.Parameter(torch.zeros(n)), ShardSpec(f"p{i}", (n,))) for i, n in enumerate((60, 50, 7))]
    params += [set_spec(nn.Parameter(torch.zeros(5, 1)), ShardSpec("w", (5, 1)))]
    grads = GradBuffers(params, Layout.single(), bucket_mb=SMALL_BUCKET_MB)
    no_decay, decay = grads.buffers
    assert (no_decay.decay, decay.decay) == (False, True)
    assert no_decay.offsets == [0, 60, 128] and no_decay.buckets == [(0, 128), (128, 192)]
    assert decay.buckets == [(0, 64)] and params[3].main_grad.data_ptr() == decay.data.data_ptr()
    assert params[2].main_grad.data_ptr() == no_decay.data[128:].data_ptr()


def test_micro_batches_accumulate_in_fp32_and_backward_after_finalize_fails():
    param = set_spec(nn.Parameter(torch.ones(3, 2, dtype=torch.bfloat16)), ShardSpec("w", (3, 2)))
    grads = GradBuffers([param], Layout.single())
    scales = (1.0, 2.0**-9)  # the second is lost when added to 1 in bf16 (8 mantissa bits), not in fp32
    for s in scales:
        (param.float().sum() * s).backward()
    assert param.grad is None and param.main_grad.dtype == torch.float32
    assert torch.equal(param.main_grad, torch.full((3, 2), 1.0 + 2.0**-9))
    grads.finalize()
    with pytest.raises(RuntimeError, match="w: backward after finalize"):
        param.float().sum().backward()
    grads.zero()
    param.float().sum().backward()
    assert torch.equal(param.main_grad, torch.ones(3, 2))


def test_dropped_params_and_buffers_are_freed():
    """The accumulate hooks live where the garbage collector cannot follow them: if they held the GradBuffers (and
    through it the params), a dropped model and its gradients would stay in memory for good (each engine a bench or
    a test builds after another would add to the peak)."""
    param = set_spec(nn.Parameter(torch.ones(3, 2)), ShardSpec("w", (3, 2)))
    grads = GradBuffers([param], Layout.single())
    param.sum().backward()
    param_alive, grads_alive = weakref.ref(param), weakref.ref(grads)
    del param, grads
    gc.collect()
    assert param_alive() is None and grads_alive() is None


def test_bad_specs_are_named():
    layout = Layout.single()
    with pytest.raises(ValueError, match="w: sum_grad_over_group is for replicated params"):
        GradBuffers([set_spec(nn.Parameter(torch.zeros(2)), ShardSpec("w", (2,), dim=0, sum_grad_over_group=True))],
                    layout)
    with pytest.raises(ValueError, match="v: num_shards=2 does not divide group 'tp' of size 1"):
        GradBuffers([set_spec(nn.Parameter(torch.zeros(1)), ShardSpec("v", (2,), dim=0, num_shards=2))], layout)
