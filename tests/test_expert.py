"""MoE layer at one process: parity with HF sparse blocks, a per-token reference, the router losses by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from shardrl.parallel.data import GradBuffers
from shardrl.parallel.expert import MoELayer, MoENames, RouterOptions
from shardrl.parallel.grouped_gemm import expert_ffn
from shardrl.parallel.layout import Layout
from shardrl.parallel.spec import get_spec

H, F_SIZE, E, K = 16, 8, 4, 2
NAMES = MoENames(
    router="model.layers.0.mlp.gate.weight",
    gate="model.layers.0.mlp.experts.{expert}.gate_proj.weight",
    up="model.layers.0.mlp.experts.{expert}.up_proj.weight",
    down="model.layers.0.mlp.experts.{expert}.down_proj.weight",
)
ATOL = dict(atol=1e-5, rtol=1e-5)


def full_weights(seed: int, hidden: int, ffn: int, experts: int) -> dict[str, torch.Tensor]:
    """HF-shaped full weights: router [E, H], gate/up [E, F, H], down [E, H, F]."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        router=torch.randn(experts, hidden, generator=g),
        gate=torch.randn(experts, ffn, hidden, generator=g) * 0.3,
        up=torch.randn(experts, ffn, hidden, generator=g) * 0.3,
        down=torch.randn(experts, hidden, ffn, generator=g) * 0.3,
    )


def load_full(layer: MoELayer, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's pieces of the full weights into the layer, reading only the shard specs."""
    params = dict(router=layer.router.weight, gate=layer.w_gate, up=layer.w_up, down=layer.w_down)
    with torch.no_grad():
        for key, param in params.items():
            spec = get_spec(param)
            if spec.expert_ids is None:
                param.copy_(full[key])
                continue
            lo, hi = spec.slice_range()
            for i, e in enumerate(spec.expert_ids):
                param[i].copy_(full[key][e].narrow(spec.dim, lo, hi - lo))


def reference_moe(x, w: dict[str, torch.Tensor], top_k: int, norm_topk: bool,
                  experts: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token, expert by expert: the textbook top-k MoE; with `experts` [T, k], token t goes through
    experts[t] (routing replay) instead of its own top-k, weighed by its router's probabilities of them."""
    outputs = []
    for t, token in enumerate(x):
        probs = torch.softmax(w["router"] @ token, dim=-1)
        chosen = (sorted(range(probs.numel()), key=lambda e: -probs[e].item())[:top_k] if experts is None
                  else experts[t].tolist())
        total = sum(probs[e] for e in chosen) if norm_topk else 1.0
        y = torch.zeros_like(token)
        for e in chosen:
            hidden = F.silu(w["gate"][e] @ token) * (w["up"][e] @ token)
            y = y + probs[e] / total * (w["down"][e] @ hidden)
        outputs.append(y)
    return torch.stack(outputs)


def reference_router_losses(x, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Switch load-balancing loss (fractions of the T*k assignments) and the ST-MoE z-loss over tokens x."""
    logits = x @ router.T
    probs = torch.softmax(logits, dim=-1)
    num_tokens, num_experts = probs.shape
    assigned = [0] * num_experts
    for row in probs:
        for e in sorted(range(num_experts), key=lambda e: -row[e].item())[:top_k]:
            assigned[e] += 1
    aux = num_experts * sum(assigned[e] / (num_tokens * top_k) * probs[:, e].mean() for e in range(num_experts))
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return aux, z


def make_layer(norm_topk: bool, **kwargs) -> MoELayer:
    return MoELayer(H, F_SIZE, E, K, Layout.single(), NAMES, norm_topk_prob=norm_topk, **kwargs)


def copy_into_hf(block: torch.nn.Module, w: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        block.gate.weight.copy_(w["router"])
        block.experts.gate_up_proj.copy_(torch.cat([w["gate"], w["up"]], dim=1))
        block.experts.down_proj.copy_(w["down"])


def hf_block(name: str, hidden: int = H, ffn: int = F_SIZE, experts: int = E) -> tuple[torch.nn.Module, bool]:
    """A tiny HF sparse MoE block and whether it renormalises its top-k weights.

    transformers is imported here, not at module level, because the multi-rank workers import this module's helpers
    and each would otherwise spend seconds importing it.
    """
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    qwen = dict(hidden_size=hidden, moe_intermediate_size=ffn, num_experts=experts, num_experts_per_tok=K)
    if name == "mixtral":  # Mixtral always renormalises (no config switch)
        config = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts,
                               num_experts_per_tok=K)
        return MixtralSparseMoeBlock(config), True
    if name == "qwen2":
        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(**qwen, norm_topk_prob=False,
                                                      shared_expert_intermediate_size=ffn))
        with torch.no_grad():  # the shared expert is the model block's job: silence it, leaving the routed experts
            for p in block.shared_expert.parameters():
                p.zero_()
        return block, False
    norm = name == "qwen3_norm"
    return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**qwen, norm_topk_prob=norm)), norm


@pytest.mark.parametrize("name", ["qwen3_norm", "qwen3_raw", "qwen2", "mixtral"])
def test_matches_hf_sparse_block(name):
    block, norm_topk = hf_block(name)
    w = full_weights(1, H, F_SIZE, E)
    copy_into_hf(block, w)
    layer = make_layer(norm_topk=norm_topk)
    load_full(layer, w)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(2))
    x_hf, x_ours = x.clone().requires_grad_(), x.view(-1, H).clone().requires_grad_()
    expected, ours = block(x_hf), layer(x_ours)
    torch.testing.assert_close(ours, expected.view(-1, H), **ATOL)

    grad_out = torch.randn_like(ours)
    (expected.view(-1, H) * grad_out).sum().backward()
    (ours * grad_out).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad.view(-1, H), **ATOL)
    torch.testing.assert_close(layer.router.weight.grad, block.gate.weight.grad, **ATOL)
    gate_up = torch.cat([layer.w_gate.grad, layer.w_up.grad], dim=1)
    torch.testing.assert_close(gate_up, block.experts.gate_up_proj.grad, **ATOL)
    torch.testing.assert_close(layer.w_down.grad, block.experts.down_proj.grad, **ATOL)


def test_matches_per_token_reference_with_an_idle_expert():
    w = full_weights(3, H, F_SIZE, E)
    w["router"][3] = -10.0 * w["router"][3].abs()  # positive tokens never pick expert 3
    x = torch.rand(7, H)
    layer = make_layer(norm_topk=False, router=RouterOptions(aux_loss_coef=0.01))
    load_full(layer, w)
    torch.testing.assert_close(layer(x), reference_moe(x, w, K, norm_topk=False), **ATOL)
    assert layer.last_tokens_per_expert[3] == 0 and layer.last_tokens_per_expert.sum() == 7 * K


@pytest.mark.parametrize("top_k", [1, 3])
def test_bitwise_choice_sum_has_the_default_gradients(top_k):
    """Bitwise mode adds a token's top-k probabilities in choice order (one autograd node): the default's output and
    gradients up to float rounding."""
    w = full_weights(5, H, F_SIZE, E)
    x = torch.randn(9, H)
    grads = []
    for bitwise in (False, True):
        layer = MoELayer(H, F_SIZE, E, top_k, Layout.single(), NAMES, norm_topk_prob=True, bitwise=bitwise)
        load_full(layer, w)
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        (out * torch.arange(H)).sum().backward()
        grads.append((out.detach(), inputs.grad, layer.router.weight.grad))
    for default, ordered in zip(*grads):
        torch.testing.assert_close(ordered, default, **ATOL)


def test_zero_tokens():
    layer = make_layer(norm_topk=True, router=RouterOptions(aux_loss_coef=0.1, z_loss_coef=0.1))
    x = torch.zeros(0, H, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, H) and layer.last_tokens_per_expert.tolist() == [0] * E


def test_router_losses_hand_computed():
    # Two tokens, three experts, top-1. Router logits are x itself padded with a zero:
    #   token 0: logits (ln 4, 0, 0) -> probs (2/3, 1/6, 1/6) -> expert 0
    #   token 1: logits (0, ln 4, 0) -> probs (1/6, 2/3, 1/6) -> expert 1
    # assignment fractions f = (1/2, 1/2, 0); mean probs P = (5/12, 5/12, 1/6)
    # aux = 3 * (1/2 * 5/12 + 1/2 * 5/12) = 5/4; z = mean(logsumexp^2) = (ln 6)^2.
    names = MoENames("r", "g{expert}", "u{expert}", "d{expert}")
    layer = MoELayer(2, 4, 3, 1, Layout.single(), names, norm_topk_prob=False,
                     router=RouterOptions(aux_loss_coef=1.0, z_loss_coef=1.0))
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    layer(torch.tensor([[math.log(4), 0.0], [0.0, math.log(4)]]))
    assert layer.last_aux_loss.item() == pytest.approx(1.25, abs=1e-6)
    assert layer.last_z_loss.item() == pytest.approx(math.log(6) ** 2, abs=1e-6)
    assert layer.last_tokens_per_expert.tolist() == [1, 1, 0]


def test_router_losses_change_only_the_gradient():
    w = full_weights(4, H, F_SIZE, E)
    x = torch.randn(9, H)
    grad_out = torch.randn(9, H)
    aux_coef, z_coef, scale = 0.3, 0.05, 0.25
    runs = {}
    for coefs in ((0.0, 0.0), (aux_coef, z_coef)):
        layer = make_layer(norm_topk=True, router=RouterOptions(aux_loss_coef=coefs[0], z_loss_coef=coefs[1]))
        layer.aux_loss_scale = scale
        load_full(layer, w)
        xi = x.clone().requires_grad_()
        out = layer(xi)
        (out * grad_out).sum().backward()
        runs[coefs] = (out.detach(), layer.router.weight.grad, xi.grad, layer.w_gate.grad)
    plain, with_loss = runs[(0.0, 0.0)], runs[(aux_coef, z_coef)]
    torch.testing.assert_close(with_loss[0], plain[0], atol=0, rtol=0)  # forward untouched
    torch.testing.assert_close(with_loss[3], plain[3], atol=0, rtol=0)  # experts do not see the router losses

    router = w["router"].clone().requires_grad_()
    xr = x.clone().requires_grad_()
    aux, z = reference_router_losses(xr, router, K)
    (scale * (aux_coef * aux + z_coef * z)).backward()
    torch.testing.assert_close(with_loss[1] - plain[1], router.grad, **ATOL)
    torch.testing.assert_close(with_loss[2] - plain[2], xr.grad, **ATOL)


def test_no_router_statistics_without_a_router_loss():
    """With both coefficients 0 a training forward computes no router statistics (at TP > 1 each would cost an
    all-reduce per layer) and returns the experts' output itself."""
    layer = make_layer(norm_topk=True)
    out = layer(torch.randn(4, H, requires_grad=True))
    assert layer.last_aux_loss is None and layer.last_tokens_per_expert is None
    assert "InjectLossGrad" not in type(out.grad_fn).__name__


def test_no_router_loss_graph_without_grad():
    layer = make_layer(norm_topk=True, router=RouterOptions(aux_loss_coef=1.0))
    with torch.no_grad():
        out = layer(torch.randn(4, H))
    # Inference computes no router losses (nor, at TP > 1, the all-reduce of their statistics per layer).
    assert out.grad_fn is None and layer.last_aux_loss is None


def test_looped_ffn_is_a_gemm_per_expert_slice():
    w = full_weights(5, H, F_SIZE, E)
    counts = torch.tensor([3, 0, 2, 1])
    x = torch.randn(int(counts.sum()), H)
    expected, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        expected.append((F.silu(rows @ w["gate"][e].T) * (rows @ w["up"][e].T)) @ w["down"][e].T)
        start += n
    ours = expert_ffn(x, counts, w["gate"], w["up"], w["down"], grouped=False)
    torch.testing.assert_close(ours, torch.cat(expected), **ATOL)


def test_grouped_ffn_accumulates_expert_gradients_into_main_grad():
    """The grouped path's own autograd (torch's grouped GEMM runs on CPU too): over three micro batches the input
    gradients equal the per-expert loop's, and each expert weight's fp32 main_grad is the sum of the loop's weight
    gradients, with no `.grad` left on the weights (added by the backward itself, not by autograd and the hook)."""
    layer = make_layer(norm_topk=True)
    buffers = GradBuffers(layer.parameters(), Layout.single())
    buffers.zero()
    weights = [layer.w_gate, layer.w_up, layer.w_down]
    loop_weights = [w.detach().clone().requires_grad_() for w in weights]
    counts = torch.tensor([3, 0, 5, 2])
    generator = torch.Generator().manual_seed(9)
    for _ in range(3):
        x = torch.randn(int(counts.sum()), H, generator=generator)
        grad = torch.randn(int(counts.sum()), H, generator=generator)
        x_grouped, x_loop = x.clone().requires_grad_(), x.clone().requires_grad_()
        expert_ffn(x_grouped, counts, *weights, grouped=True).backward(grad)
        expert_ffn(x_loop, counts, *loop_weights, grouped=False).backward(grad)  # autograd accumulates .grad
        torch.testing.assert_close(x_grouped.grad, x_loop.grad, **ATOL)
    for weight, reference in zip(weights, loop_weights):
        assert weight.grad is None
        assert reference.grad.abs().sum() > 0
        torch.testing.assert_close(weight.main_grad, reference.grad, **ATOL)


def test_bad_sizes_name_the_router():
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate.weight: top_k=5"):
        MoELayer(H, F_SIZE, E, 5, Layout.single(), NAMES, norm_topk_prob=True)


def test_fp32_router_logits_are_the_fp32_product_of_bf16_inputs():
    """`moe_router_dtype=fp32`: in a bf16 layer the router GEMM runs in fp32; the z-loss (mean logsumexp(logits)^2)
    matches one computed from the fp32 product, and the default bf16 GEMM's does not."""
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(64, H, generator=generator) * 3).to(torch.bfloat16)
    expected = {}
    for fp32 in (True, False):
        layer = make_layer(norm_topk=True, router=RouterOptions(z_loss_coef=1.0, fp32_logits=fp32),
                           dtype=torch.bfloat16)
        with torch.no_grad():
            layer.router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(6)))
        layer(x.clone().requires_grad_())
        reference = torch.logsumexp(x.float() @ layer.router.weight.float().T, dim=-1).square().mean()
        expected[fp32] = (layer.last_z_loss, reference)
    torch.testing.assert_close(*expected[True], rtol=1e-6, atol=0)
    assert not torch.allclose(*expected[False], rtol=1e-4, atol=0)
