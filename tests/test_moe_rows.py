"""MoE dispatch and combine (`parallel/moe_rows.py`, the portable path) against plain per-assignment indexing in fp64,
whose autograd is the independent reference: values and every gradient, with tokens routed to the same expert
several times and experts no token chose."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from shardrl.parallel.moe_rows import combine_rows, dispatch_rows


def _routing(num_tokens: int, top_k: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)  # repeats allowed
    order = experts.flatten().argsort(stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return order, inverse


def test_dispatch_and_combine_match_per_assignment_indexing():
    num_tokens, top_k, hidden = 11, 3, 6
    order, inverse = _routing(num_tokens, top_k, num_experts=5, seed=0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(num_tokens * top_k, hidden, generator=gen, dtype=torch.float64)  # a stand-in "expert"
    weights = torch.rand(num_tokens, top_k, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float64)

    rows = dispatch_rows(x, order, inverse, top_k)
    out = combine_rows(rows * scale, order, inverse, weights)
    out.backward(grad_out)

    ref_x, ref_w = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    ref_rows = torch.stack([ref_x[int(a) // top_k] for a in order])  # row r holds assignment order[r]
    assert torch.equal(rows, ref_rows)
    y = ref_rows * scale
    ref_out = torch.stack([sum(ref_w[t, j] * y[int(inverse[t * top_k + j])] for j in range(top_k))
                           for t in range(num_tokens)])
    ref_out.backward(grad_out)
    assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    assert_close(weights.grad, ref_w.grad, rtol=1e-12, atol=1e-12)
