"""The fused Triton vocab kernels (`parallel/vocab_kernels.py`) against the torch reference of `parallel/vocab.py`
and a full log_softmax: statistics, logprobs, entropies and the logits' gradient, in fp32 and bf16, across tile
boundaries, with padded vocab columns, with targets held by another rank, and with each upstream gradient alone."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from shardrl.parallel.vocab import logits_grad_reference, softmax_stats_reference, vocab_parallel_logprobs

pytestmark = pytest.mark.gpu

# (tokens, columns held, real vocab): one tile, a partial last tile, several tiles, padding at the tail
SHAPES = [(7, 100, 100), (33, 4096 + 1000, 4096 + 1000), (5, 3 * 4096, 3 * 4096 - 77), (64, 32000, 32000)]
UPSTREAM = [(True, True), (True, False), (False, True)]


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_stats_and_gradient_kernels_match_the_torch_reference(shape, dtype):
    device = _cuda()
    from shardrl.parallel.vocab_kernels import block_grad, block_stats  # Triton: CUDA installs only

    num_tokens, num_cols, num_valid = shape
    g = torch.Generator(device="cpu").manual_seed(num_cols)
    logits = (torch.randn(num_tokens, num_cols, generator=g) * 4).to(device, dtype)
    stats = block_stats(logits[:, :num_valid], num_valid)
    expected = softmax_stats_reference(logits[:, :num_valid].double(), 2**26)
    assert torch.equal(stats[0].double(), expected[0].double())  # the max is exact
    assert_close(stats[1].double(), expected[1].double(), rtol=1e-5, atol=0)
    assert_close((stats[2] / stats[1]).double(), (expected[2] / expected[1]).double(), rtol=1e-5, atol=1e-5)
    log_norm = (expected[0] + expected[1].log()).float()
    mean_z = (expected[2] / expected[1]).float()
    targets = torch.randint(0, num_valid, (num_tokens,), generator=g).to(device)
    mine = torch.rand(num_tokens, generator=g).to(device) < 0.7  # the rest: another rank holds the target
    index = targets.unsqueeze(-1)
    for use_lp, use_ent in UPSTREAM:
        up_lp = torch.randn(num_tokens, generator=g).to(device) if use_lp else None
        up_ent = torch.randn(num_tokens, generator=g).to(device) if use_ent else None
        got = block_grad(logits, log_norm, mean_z, up_lp, up_ent, torch.where(mine, targets, -1).int(), num_valid)
        want = logits_grad_reference(logits, log_norm, mean_z, up_lp, up_ent, index, mine, num_valid, 2**26)
        assert got.dtype == dtype and got.shape == logits.shape
        assert torch.all(got[:, num_valid:] == 0)
        tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
        assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_logprobs_on_cuda_match_log_softmax(dtype):
    """The whole autograd function on CUDA (kernels) against log_softmax in fp64 on the same rounded logits."""
    device = _cuda()
    num_tokens, vocab, padded = 300, 50_000, 50_048
    g = torch.Generator(device="cpu").manual_seed(0)
    real = torch.randn(num_tokens, vocab, generator=g) * 3
    held = torch.cat([real, torch.full((num_tokens, padded - vocab), 1e4)], dim=-1)  # padding must not count
    logits = held.to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=g).to(device)
    up_lp, up_ent = torch.randn(num_tokens, generator=g).to(device), torch.randn(num_tokens, generator=g).to(device)
    lp, ent = vocab_parallel_logprobs(logits, targets, None, vocab)
    (lp * up_lp + ent * up_ent).sum().backward()

    full = logits.detach()[:, :vocab].double().requires_grad_()
    logp = torch.log_softmax(full, dim=-1)
    ref_lp, ref_ent = logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    (ref_lp * up_lp + ref_ent * up_ent).sum().backward()
    assert lp.dtype == ent.dtype == torch.float32
    assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    assert torch.all(logits.grad[:, vocab:] == 0)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    assert_close(logits.grad[:, :vocab].double(), full.grad.to(dtype).double(), **tol)
