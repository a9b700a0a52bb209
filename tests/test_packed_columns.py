"""Packed column-parallel linears (q/k/v, gate/up of an inference engine): one GEMM, the same outputs, the same
params (HF names, in-place loads), and a fallback wherever the packing does not hold."""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close

from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.layout import Layout
from shardrl.parallel.tensor import ColumnParallelLinear, apply_columns, pack_adjacent, unpack
from shardrl.rollout.engine import Engine, EngineConfig


class CountLinear(TorchFunctionMode):
    """Counts F.linear calls (each one GEMM)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is F.linear
        return func(*args, **(kwargs or {}))


def make_linears(bias: tuple[bool, ...]) -> list[ColumnParallelLinear]:
    torch.manual_seed(0)
    layout = Layout.single()
    linears = [ColumnParallelLinear(8, out, layout, f"l{i}", b) for i, (out, b) in enumerate(zip((6, 4, 4), bias))]
    for linear in linears:
        for param in linear.parameters():
            param.data.normal_()
    return linears


def run(x: torch.Tensor, linears: list[ColumnParallelLinear]) -> tuple[list[torch.Tensor], int]:
    with torch.no_grad(), CountLinear() as count:
        out = apply_columns(x, linears)
    return out, count.calls


def test_packed_linears_run_as_one_gemm_with_the_same_outputs_and_params():
    linears = make_linears((True, True, True))
    x = torch.randn(5, 8)
    expected = [F.linear(x, lin.weight, lin.bias) for lin in linears]  # the hand reference: one linear each
    params_before = [p for lin in linears for p in lin.parameters()]
    values_before = [p.detach().clone() for p in params_before]
    pack_adjacent(linears, torch.device("cpu"))
    assert [p for lin in linears for p in lin.parameters()] == params_before  # same Parameter objects
    assert all(torch.equal(p, v) for p, v in zip(params_before, values_before))
    out, calls = run(x, linears)
    assert calls == 1 and [o.shape for o in out] == [(5, 6), (5, 4), (5, 4)]
    for got, want in zip(out, expected):
        assert_close(got, want)
    with torch.no_grad():  # an in-place load (what update_weights and sync do) keeps the packing
        linears[1].weight.copy_(torch.ones(4, 8))
    out, calls = run(x, linears)
    assert calls == 1 and torch.allclose(out[1], x.sum(-1, keepdim=True).expand(5, 4) + linears[1].bias)


def test_unpacked_biased_or_autograd_runs_one_gemm_each():
    x = torch.randn(5, 8)
    linears = make_linears((True, True, True))
    assert run(x, linears)[1] == 3  # never packed
    pack_adjacent(linears, torch.device("cpu"))
    linears[2].weight.data = linears[2].weight.data.clone()  # new .data (an offload) unpacks that param
    out, calls = run(x, linears)
    assert calls == 3 and torch.allclose(out[2], F.linear(x, linears[2].weight, linears[2].bias))
    pack_adjacent(linears, torch.device("cpu"))
    assert run(x, linears)[1] == 1  # packed again
    mixed = make_linears((True, False, True))  # some with a bias, some without: the weights pack, the biases not
    pack_adjacent(mixed, torch.device("cpu"))
    out, calls = run(x, mixed)
    assert calls == 3 and torch.allclose(out[1], F.linear(x, mixed[1].weight))
    with CountLinear() as count:  # with autograd each param gets its own gradient
        sum(o.sum() for o in apply_columns(x, linears)).backward()
    assert count.calls == 3
    assert torch.allclose(linears[0].weight.grad, x.sum(0).expand(6, 8))


def test_compiled_packed_linears_run_as_one_gemm_until_unpacked():
    """Under torch.compile (the engine's `compile_decode`) the views `pack_adjacent` kept stand in for the storage
    check: one GEMM in the traced graph, the same outputs, in-place loads seen; `unpack` (before an offload) drops
    them and the group runs one GEMM each again."""
    linears = make_linears((True, True, True))
    x = torch.randn(5, 8)
    traced_gemms = []

    def count_gemms(graph_module, example_inputs):
        traced_gemms.append(sum(node.target is F.linear for node in graph_module.graph.nodes))
        return graph_module.forward

    def columns(x):
        return apply_columns(x, linears)

    pack_adjacent(linears, torch.device("cpu"))
    with torch.no_grad():
        out = torch.compile(columns, backend=count_gemms)(x)
        linears[1].weight.copy_(torch.ones(4, 8))  # in place: the packed views see it
        again = torch.compile(columns, backend=count_gemms)(x)
    assert traced_gemms[0] == 1
    for got, lin in zip(out, make_linears((True, True, True))):  # the values before the in-place load
        assert_close(got, F.linear(x, lin.weight, lin.bias))
    assert_close(again[1], F.linear(x, linears[1].weight, linears[1].bias))
    unpack(linears)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(columns, backend=count_gemms)(x)
    assert traced_gemms[-1] == 3


def test_engine_packs_qkv_and_gate_up_and_keeps_them_packed_across_weight_updates(tmp_path):
    path = make_tiny_checkpoint("qwen2", tmp_path / "ckpt")  # q/k/v with biases
    config = ModelConfig.from_pretrained(path)
    engine = Engine(config, Layout.single(), EngineConfig(max_num_seqs=4, max_model_len=64,
                                                           max_num_batched_tokens=64, cpu_kv_cache_tokens=256))
    groups = engine.runner.model.column_groups()
    assert len(groups) == 2 * config.num_layers

    def packed() -> bool:
        return all(len({p.untyped_storage().data_ptr() for lin in g for p in lin.parameters()
                        if p.dim() == 2}) == 1 for g in groups)

    assert packed()
    q_proj = groups[0][0].weight
    engine.update_weights([("model.layers.0.self_attn.q_proj.weight", torch.full(q_proj.shape, 0.5))])
    assert packed() and torch.equal(q_proj, torch.full(q_proj.shape, 0.5))
