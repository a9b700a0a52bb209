"""Overlapped tensor-parallel linears (tensor_overlap.py) and the fast paths of the model, on gloo at TP2.

Each result is checked against a single-process torch computation with the full weights, and the forward output
against the plain (non-overlapped) TP path to fp32 rounding: the chunked GEMMs and collectives compute every element
with the same operations, though a CPU BLAS may order a GEMM's sums differently for a chunk of one or two rows (seen
on one Xeon: the 5-piece split of 7 tokens differed in the last bit). Gradients take the same sums in another order,
so they are compared with tolerances.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from shardrl.models.config import ModelConfig, RopeConfig
from shardrl.models.fast_paths import FastPaths, elementwise
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.norm import rms_norm
from shardrl.models.rope import RotaryEmbedding, apply_rope
from shardrl.parallel.activation import swiglu
from shardrl.models.tiny import make_tiny_checkpoint, packed_batch
from shardrl.models.transformer import Transformer
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.spec import get_spec
from shardrl.parallel.tensor import ColumnParallelLinear, RowParallelLinear, token_split_sizes
from shardrl.parallel.tensor_overlap import TPOverlap, column_parallel, row_parallel

T, H, F_SIZE = 7, 8, 6  # 7 tokens: SP chunks of 4 and 3, and pieces of uneven sizes (some empty at 5 pieces)


def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shapes = {"gate.weight": (F_SIZE, H), "gate.bias": (F_SIZE,), "up.weight": (F_SIZE, H), "down.weight": (H, F_SIZE),
              "down.bias": (H,), "x": (T, H), "grad_y": (T, H)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _load(params: dict[str, torch.Tensor], t: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in params.items():
            spec = get_spec(param)
            full = t[name]
            if spec.dim is not None:
                start, stop = spec.slice_range()
                full = full.narrow(spec.dim, start, stop - start)
            param.copy_(full)


def _chunk(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    return x.split(token_split_sizes(x.shape[0], layout.tp_size))[layout.tp_rank]


def _run_mlp(layout: Layout, t: dict, sp: bool, overlap: TPOverlap) -> dict[str, torch.Tensor]:
    """A gate/up/down block through `column_parallel` and `row_parallel`: output and every gradient."""
    gate = ColumnParallelLinear(H, F_SIZE, layout, "gate", bias=True)
    up = ColumnParallelLinear(H, F_SIZE, layout, "up")
    down = RowParallelLinear(F_SIZE, H, layout, "down", bias=True, sequence_parallel=sp)
    _load({"gate.weight": gate.weight, "gate.bias": gate.bias, "up.weight": up.weight, "down.weight": down.weight,
           "down.bias": down.bias}, t)
    x = (_chunk(t["x"], layout) if sp else t["x"]).clone().requires_grad_()
    a, b = column_parallel(x, (gate, up), layout.tp_group, sp, T, overlap.backward)
    y = row_parallel(swiglu(a, b), down, overlap.chunks)  # [T, H] or [T_r, H]
    (y * (_chunk(t["grad_y"], layout) if sp else t["grad_y"])).sum().backward()
    return {"y": y.detach(), "x": x.grad, "gate.weight": gate.weight.grad, "gate.bias": gate.bias.grad,
            "up.weight": up.weight.grad, "down.weight": down.weight.grad}


def _reference(t: dict) -> dict[str, torch.Tensor]:
    leaves = {name: t[name].clone().requires_grad_() for name in ("x", "gate.weight", "gate.bias", "up.weight",
                                                                    "down.weight")}
    hidden = F.silu(F.linear(leaves["x"], leaves["gate.weight"], leaves["gate.bias"])) * F.linear(
        leaves["x"], leaves["up.weight"])
    y = F.linear(hidden, leaves["down.weight"], t["down.bias"])
    (y * t["grad_y"]).sum().backward()
    return {"y": y.detach(), **{name: leaf.grad for name, leaf in leaves.items()}}


def overlapped_mlp(sp: bool) -> list[str]:
    layout = Layout.create(LayoutSpec(world_size=2, tp=2))
    t = _full_tensors()
    ref = _reference(t)
    plain = _run_mlp(layout, t, sp, TPOverlap(backward=False, chunks=1))
    checked = []
    for overlap in (TPOverlap(backward=True, chunks=1), TPOverlap(backward=True, chunks=2),
                    TPOverlap(backward=False, chunks=3), TPOverlap(backward=True, chunks=5)):
        got = _run_mlp(layout, t, sp, overlap)
        # Same operations per element, but a BLAS may pick another kernel (and summation order) for a few rows.
        assert_close(got["y"], plain["y"], atol=1e-6, rtol=1e-6, msg=str(overlap))
        assert_close(got["y"], _chunk(ref["y"], layout) if sp else ref["y"])
        assert_close(got["x"], _chunk(ref["x"], layout) if sp else ref["x"])
        for name in ("gate.weight", "gate.bias", "up.weight"):  # rows of this rank's output features
            assert_close(got[name], ref[name].chunk(2)[layout.tp_rank])
        assert_close(got["down.weight"], ref["down.weight"].chunk(2, dim=1)[layout.tp_rank])
        checked.append(f"{overlap.backward}/{overlap.chunks}")
    return checked


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_overlapped_column_and_row_parallel_match_reference(sp):
    out = run_distributed(2, overlapped_mlp, sp)
    assert out[0] == out[1] == ["True/1", "True/2", "False/3", "True/5"]


def _model_step(config: ModelConfig, ckpt: Path, layout: Layout, batch: tuple, sp: bool,
                fast: FastPaths) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logprobs [T] and every gradient, summed over TP where the spec says so, keyed by HF name."""
    input_ids, position_ids, cu_seqlens = batch
    model = Transformer(config, layout, sequence_parallel=sp, fast=fast)
    load_hf_weights(model, ckpt)
    lp, ent = model.compute_logprobs(model(input_ids, position_ids, cu_seqlens), input_ids.roll(-1))
    (lp.sum() + 0.5 * ent.sum()).backward()
    grads = {}
    for param in model.parameters():
        spec, grad = get_spec(param), param.grad.clone()
        if spec.sum_grad_over_group:
            dist.all_reduce(grad, group=layout.tp_group)
        grads[spec.hf_name] = grad
    return lp.detach(), grads


def overlapped_model(ckpt: Path, batch: tuple) -> int:
    """A Llama at TP2 with chunked row-parallel forward, SP off and on, against the single-process model."""
    config = ModelConfig.from_pretrained(ckpt)
    ref_lp, ref_grads = _model_step(config, ckpt, Layout.single(), batch, False, FastPaths())
    layout = Layout.create(LayoutSpec(world_size=2, tp=2))
    model = Transformer(config, layout)  # for the specs of this rank's shards
    specs = {get_spec(p).hf_name: get_spec(p) for p in model.parameters()}
    for sp in (False, True):
        lp, grads = _model_step(config, ckpt, layout, batch, sp, FastPaths(TPOverlap(backward=True, chunks=3)))
        assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            ref, spec = ref_grads[name], specs[name]
            if spec.dim is not None:
                start, stop = spec.slice_range()
                ref = ref.narrow(spec.dim, start, stop - start)
            assert_close(grad, ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name} sp={sp}: {m}")
    return len(grads)


def test_overlapped_model_matches_single_process(tmp_path):
    ckpt = make_tiny_checkpoint("llama", tmp_path / "llama")
    num_grads = run_distributed(2, overlapped_model, ckpt, packed_batch([4, 3], vocab_size=128))
    assert num_grads[0] > 10  # embeddings, norms, q/k/v/o and gate/up/down of every layer


def test_overlap_chunks_must_be_positive():
    with pytest.raises(ValueError, match="tp_comm_overlap_chunks=0"):
        TPOverlap(chunks=0)


def test_rope_matches_rotate_half_formula():
    """apply_rope against the textbook x * cos + rotate_half(x) * sin with the angles written out."""
    head_dim, positions = 8, torch.tensor([0, 1, 5, 2])
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, torch.device("cpu"))
    cos, signed_sin = rope(positions)
    x = torch.randn(4, 3, head_dim)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)[:, None]  # [T, 1, D]
    first, second = x.chunk(2, dim=-1)
    expected = x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()
    assert torch.equal(apply_rope(x, cos, signed_sin), expected)  # the sign folded into sin is exact


def test_fast_paths_reach_every_layer():
    fast = FastPaths(TPOverlap(backward=False, chunks=4), compile=True)
    config = ModelConfig.from_dict(dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, intermediate_size=32, vocab_size=64, rms_norm_eps=1e-6))
    model = Transformer(config, Layout.single(), fast=fast)
    layer = model.layers[1]
    assert layer.self_attn.fast is fast and layer.mlp.fast is fast
    norms = [m for m in model.modules() if m.__class__.__name__ == "RMSNorm"]
    assert len(norms) == 2 * 2 + 2 * 2 + 1 and all(norm.compile for norm in norms)  # q/k norms of Qwen3 too


@pytest.mark.slow  # torch.compile of three functions takes a minute or more on a shared CPU
def test_compiled_elementwise_chains_match_eager():
    torch.manual_seed(0)
    x, weight = torch.randn(5, 3, 8), torch.randn(8)
    cos, signed_sin = RotaryEmbedding(RopeConfig(theta=10000.0), 8, torch.device("cpu"))(torch.arange(5))
    gate, up = torch.randn(5, 16), torch.randn(5, 16)
    for fn, args in ((rms_norm, (x, weight, 1e-6)), (apply_rope, (x, cos, signed_sin)), (swiglu, (gate, up))):
        leaves = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        compiled_leaves = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        eager, compiled = fn(*leaves), elementwise(fn, True)(*compiled_leaves)
        eager.square().sum().backward()
        compiled.square().sum().backward()
        assert_close(compiled, eager)
        for a, b in zip(compiled_leaves, leaves):
            if isinstance(a, torch.Tensor):
                assert_close(a.grad, b.grad)


def test_single_rank_columns_sum_their_input_gradients_in_one_backward():
    """Without a TP group the gate/up input gradients are summed in place by one autograd node (no collective):
    output and every gradient against torch, with the overlap flag on or off."""
    layout = Layout.single("cpu")
    t = _full_tensors()
    ref = _reference(t)
    for overlap in (TPOverlap(backward=True), TPOverlap(backward=False)):
        got = _run_mlp(layout, t, False, overlap)
        for name, value in got.items():
            assert_close(value, ref[name], msg=name)
    gate, up = (ColumnParallelLinear(H, F_SIZE, layout, name) for name in ("gate", "up"))
    x = t["x"].clone().requires_grad_()
    a, b = column_parallel(x, (gate, up), None, False, T, True)
    assert type(a.grad_fn).__name__ == type(b.grad_fn).__name__ == "_ColumnParallelBackward"
    assert type(column_parallel(x, (gate,), None, False, T, True)[0].grad_fn).__name__ != "_ColumnParallelBackward"


def test_single_rank_row_parallel_adds_the_residual_inside_its_gemm():
    """Without a TP group the residual stream joins the output projection's GEMM (no separate addition node): the
    output and the gradients of x, the weight and the residual against torch."""
    layout = Layout.single("cpu")
    t = _full_tensors()
    down = RowParallelLinear(F_SIZE, H, layout, "down")
    _load({"down.weight": down.weight}, t)
    x = torch.randn(T, F_SIZE, generator=torch.Generator().manual_seed(3)).requires_grad_()
    residual = t["x"].clone().requires_grad_()
    y = row_parallel(x, down, 1, residual)
    assert type(y.grad_fn).__name__ in ("AddmmBackward0", "_LinearBackward"), type(y.grad_fn).__name__
    (y * t["grad_y"]).sum().backward()
    leaves = [x.detach().clone().requires_grad_(), t["down.weight"].clone().requires_grad_(),
              t["x"].clone().requires_grad_()]
    want = leaves[2] + F.linear(leaves[0], leaves[1])
    (want * t["grad_y"]).sum().backward()
    assert_close(y, want)
    for got, leaf in zip((x.grad, down.weight.grad, residual.grad), leaves):
        assert_close(got, leaf.grad)
