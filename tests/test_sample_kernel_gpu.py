"""The fused CUDA sampler (`sample_kernel.py`) against the portable ops it replaces (`sample(..., fused=False)`):
each drawn token's range of the fp64 CDF holds the row's uniform (the seeded rows' from the counter hash, the
others' from the generator), logprobs are fp64 log-softmax's, greedy rows take the argmax, and tokens equal the
portable path's except where a uniform lands within rounding of a boundary."""

import pytest
import torch

from shardrl.rollout.request import SamplingParams
from shardrl.rollout.sampler import SamplingBatch, counter_uniforms, sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def _uniforms(batch, counters, seed):
    drawn = torch.rand(counters.shape[0], generator=torch.Generator(CUDA).manual_seed(seed), device=CUDA)
    return torch.where(batch.has_seed, counter_uniforms(batch.keys, counters), drawn).double()


def _check_against_fp64(logits, batch, counters, out, seed, temperatures):
    scaled = logits.double() / torch.tensor(temperatures, dtype=torch.float64, device=CUDA).unsqueeze(1)
    logp = scaled.log_softmax(-1)  # [B, V]
    rows = torch.arange(logits.shape[0], device=CUDA)
    tokens = out.token_ids
    torch.testing.assert_close(out.logprobs.double(), logp[rows, tokens], atol=2e-5, rtol=0)
    if out.raw_logprobs is not None:
        raw = logits.double().log_softmax(-1)[rows, tokens]
        torch.testing.assert_close(out.raw_logprobs.double(), raw, atol=2e-5, rtol=0)
    greedy = batch.greedy
    assert torch.equal(tokens[greedy], logits[greedy].float().argmax(-1))
    cdf = logp.exp().cumsum(-1)  # [B, V]
    upper = cdf[rows, tokens]
    lower = upper - logp[rows, tokens].exp()
    u = _uniforms(batch, counters, seed)
    slack = 1e-5  # of the row's mass: fp32 sums in another order
    sampled = ~greedy
    assert ((lower - slack <= u) & (u < upper + slack))[sampled].all()


@pytest.mark.parametrize("vocab,rows,dtype", [(10_000, 64, torch.float32), (151_936, 256, torch.bfloat16)])
def test_fused_sampler_draws_the_portable_distribution(vocab, rows, dtype):
    generator = torch.Generator(CUDA).manual_seed(vocab)
    padded = torch.randn(rows, vocab + 64, generator=generator, device=CUDA) * 3
    logits = padded[:, :vocab].to(dtype) if dtype != torch.float32 else padded[:, :vocab]  # row stride != vocab
    temperatures = [[1.0, 0.7, 0.0, 1.3][i % 4] for i in range(rows)]
    params = [SamplingParams(temperature=t, raw_logprobs=i % 3 == 0) for i, t in enumerate(temperatures)]
    seeds = [1000 + i if i % 2 else None for i in range(rows)]
    batch = SamplingBatch.build(params, seeds, vocab, CUDA)
    counters = torch.randint(0, 2**31, (rows,), generator=generator, device=CUDA)
    fused = sample(logits, batch, counters, torch.Generator(CUDA).manual_seed(7))
    portable = sample(logits, batch, counters, torch.Generator(CUDA).manual_seed(7), fused=False)
    _check_against_fp64(logits, batch, counters, fused, 7, [t or 1.0 for t in temperatures])
    same = (fused.token_ids == portable.token_ids).float().mean().item()
    assert same >= 0.95, same
    assert torch.equal(fused.token_ids, sample(logits, batch, counters, torch.Generator(CUDA).manual_seed(7)).token_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_fused_sampler_unit_temperature_and_all_greedy(temperature):
    generator = torch.Generator(CUDA).manual_seed(3)
    logits = (torch.randn(96, 50_000, generator=generator, device=CUDA) * 4).bfloat16()
    params = [SamplingParams(temperature=temperature)] * 96
    batch = SamplingBatch.build(params, [5 * i for i in range(96)], 50_000, CUDA)
    counters = torch.arange(96, device=CUDA) * 11
    out = sample(logits, batch, counters, torch.Generator(CUDA).manual_seed(1))
    assert out.raw_logprobs is None
    _check_against_fp64(logits, batch, counters, out, 1, [1.0] * 96)
    # rows do not depend on their batch: the first 40 rows alone draw the same tokens with the same logprobs
    part = SamplingBatch.build(params[:40], [5 * i for i in range(40)], 50_000, CUDA)
    alone = sample(logits[:40], part, counters[:40], torch.Generator(CUDA).manual_seed(1))
    seeded_or_greedy = part.has_seed | part.greedy
    assert torch.equal(alone.token_ids[seeded_or_greedy], out.token_ids[:40][seeded_or_greedy])
    assert torch.equal(alone.logprobs, out.logprobs[:40])
