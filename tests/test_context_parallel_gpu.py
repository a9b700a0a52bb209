"""Context parallel attention's CUDA path on one GPU: each CP share's queries, run through a fused varlen kernel
(torch's flash, FlashAttention-4 where installed) against their sequences' key prefixes, give the rows (and, summed
over the shares, the gradients) that flash attention over the whole micro batch gives. The gather over CP ranks is
the CPU tests' (tests/test_context_parallel.py) and the parity matrix's; this checks only the kernel path, which
needs no second GPU."""

from __future__ import annotations

import pytest
import torch

from shardrl.models.attention import PackedSeqs, packed_attention, shard_attention
from shardrl.parallel.context import shard_micro_batch
from test_models_gpu import KERNELS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

LENGTHS = [300, 5, 1000, 1, 77]  # some shorter than 2 x CP chunks
HEADS, KV_HEADS, DIM = 8, 2, 64


def _seqs(cu_seqlens: torch.Tensor, rows: int, shard=None) -> PackedSeqs:
    angles = torch.zeros(rows, DIM, device=cu_seqlens.device)  # only their row count is read here
    return PackedSeqs(cu_seqlens, max(LENGTHS), angles, angles, None, shard)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cp", [2, 4])
def test_each_share_attends_as_its_rows_of_the_whole_micro_batch(cp, kernel):
    torch.manual_seed(0)
    device, num_tokens = torch.device("cuda"), sum(LENGTHS)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(num_tokens, heads, DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    grad_out = torch.randn(num_tokens, HEADS, DIM, device=device, dtype=torch.bfloat16)
    whole = packed_attention(q, k, v, _seqs(cu_seqlens, num_tokens), DIM ** -0.5)  # torch's flash: the reference
    expected = torch.autograd.grad(whole, (q, k, v), grad_out)

    out = torch.empty_like(whole)
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
    for rank in range(cp):
        shard = shard_micro_batch(LENGTHS, rank, cp, None, device)
        local = shard.local_index
        q_local = q.detach()[local].requires_grad_(True)
        keys, values = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
        part = shard_attention(q_local, keys, values, _seqs(cu_seqlens, len(local), shard), DIM ** -0.5, kernel)
        out[local] = part.detach()
        dq, dk, dv = torch.autograd.grad(part, (q_local, keys, values), grad_out[local])
        grads[0][local] += dq.float()
        grads[1] += dk.float()  # each share's use of the keys: summed over CP, as the gather's backward does
        grads[2] += dv.float()

    assert (out.float() - whole.float()).abs().max() <= 2e-2 * whole.float().abs().max()
    for name, got, want in zip("qkv", grads, expected):
        err = (got - want.float()).abs().max() / want.float().abs().max()
        assert err <= 3e-2, f"d{name}: max error {err:.2e} of max |ref|"
