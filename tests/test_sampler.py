"""Sampler: hand-computed filtered distributions on a tiny vocab, HF's warpers as reference for top-k/top-p, the
counter-based uniforms of seeded rows against a Python-int reference and checked for uniformity and independence,
chi-square tests of seeded draws against the filtered softmax, batch independence, empirical frequencies."""

import math

import pytest
import torch
from seeded_sampling import reference_draw, reference_uniform
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from shardrl.rollout.request import SamplingParams, SamplingParamsError
from shardrl.rollout.sampler import (SamplingBatch, SamplingBuffers, counter_uniforms, filter_top_k_top_p,
                                     inverse_cdf, sample, seed_keys)

CPU = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])


def _batch(params, seeds=None, vocab_size=LOGITS.numel()):
    return SamplingBatch.build(params, seeds or [None] * len(params), vocab_size, CPU)


def _counters(num_rows, value=7):
    return torch.full((num_rows,), value)


def _shared(seed=0):
    return torch.Generator().manual_seed(seed)


def _chi2_critical(df):
    """The 1 - 1e-4 quantile of chi-square(df), Wilson-Hilferty's approximation (z = 3.719)."""
    return df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_filtered_logprobs_hand_checked():
    # temperature 0.5 -> [4, 2, 1, -2, 0]; top-k 3 keeps [4, 2, 1] with probs 0.8438, 0.1142, 0.0420;
    # top-p 0.9 keeps tokens whose mass above is < 0.9: tokens 0 (0) and 1 (0.8438), not 2 (0.958).
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=7, raw_logprobs=True)
    expected = {0: -math.log(1 + math.exp(-2.0)), 1: -2.0 - math.log(1 + math.exp(-2.0))}
    num_rows = 4000
    out = sample(LOGITS.expand(num_rows, -1), _batch([params] * num_rows, list(range(num_rows))),
                 _counters(num_rows))
    tokens = out.token_ids.tolist()
    assert set(tokens) == {0, 1}
    for token, logprob, raw in zip(tokens, out.logprobs.tolist(), out.raw_logprobs.tolist()):
        assert logprob == pytest.approx(expected[token], abs=1e-6)
        assert raw == pytest.approx(torch.log_softmax(LOGITS, -1)[token].item(), abs=1e-6)
    # P(token 0) = 1 / (1 + e^-2) = 0.8808; 4000 draws: standard error 0.005
    assert tokens.count(0) / num_rows == pytest.approx(1 / (1 + math.exp(-2.0)), abs=0.02)


def test_filter_matches_hf_warpers():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    for top_k, top_p in ((5, 1.0), (50, 0.7), (10, 0.5), (1, 0.3)):
        expected = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits.clone()))
        got = filter_top_k_top_p(logits, torch.full((6,), top_k), torch.full((6,), top_p))
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), (top_k, top_p)
        assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])


def test_unfiltered_logprobs_are_log_softmax_of_scaled_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.3)]
    out = sample(logits, _batch(params, vocab_size=20), _counters(3), _shared())
    scaled = TemperatureLogitsWarper(0.7)(None, logits[1:2].clone())
    assert out.logprobs[1].item() == pytest.approx(torch.log_softmax(scaled, -1)[0, out.token_ids[1]].item(),
                                                   abs=1e-6)
    for row, t in enumerate((1.0, 0.7, 1.3)):
        expected = torch.log_softmax(logits[row] / t, -1)[out.token_ids[row]]
        assert out.logprobs[row].item() == pytest.approx(expected.item(), abs=1e-6)


def test_greedy_rows_take_argmax_next_to_sampled_rows():
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.0, seed=3), SamplingParams(), SamplingParams(temperature=0.0, top_k=3),
              SamplingParams(top_p=0.5, seed=4)]
    out = sample(logits, _batch(params, [3, None, None, 4], vocab_size=30), _counters(4), _shared())
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    assert out.logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0], -1).max().item(), abs=1e-6)
    top3 = logits[2].topk(3).values
    assert out.logprobs[2].item() == pytest.approx((top3[0] - top3.logsumexp(0)).item(), abs=1e-6)


def test_counter_uniforms_equal_the_python_int_reference():
    seeds = [0, 1, 2, 12345, -1, -(2**40), 2**31 - 1, 2**32 + 7, 2**63 + 5, 2**64 + 3, 3]
    counters = [0, 1, 5, 2047, 7, 99, 2**31, 13, 1, 4, 4]
    got = counter_uniforms(seed_keys(seeds), torch.tensor(counters))
    assert got.dtype == torch.float32
    assert got.tolist() == [reference_uniform(s, c) for s, c in zip(seeds, counters)]
    assert got[-1] == got[-2]  # seeds equal modulo 2**64 share a stream


def _check_uniform(u, bins=64):
    """u [N] fp32: bin counts pass chi-square, every one of the 24 bits is set about half the time."""
    counts = torch.bincount((u * bins).long(), minlength=bins).double()
    assert _chi2(counts, torch.full((bins,), 1 / bins)) < _chi2_critical(bins - 1)
    bits = (u * 2**24).long()
    set_fraction = torch.stack([(bits >> b) & 1 for b in range(24)]).double().mean(1)  # [24]
    assert ((set_fraction - 0.5).abs() < 4 * 0.5 / math.sqrt(u.numel())).all(), set_fraction


def _check_independent(a, b, bins=8):
    """Pairs (a[i], b[i]): no linear correlation, and the 8x8 grid of pair cells passes chi-square."""
    r = torch.corrcoef(torch.stack([a, b]).double())[0, 1]
    assert abs(r) < 4 / math.sqrt(a.numel()), r
    cells = (a * bins).long() * bins + (b * bins).long()
    counts = torch.bincount(cells, minlength=bins * bins).double()
    assert _chi2(counts, torch.full((bins * bins,), 1 / bins**2)) < _chi2_critical(bins * bins - 1)


def test_uniforms_of_consecutive_counters_and_neighbouring_seeds_are_uniform_and_independent():
    n = 1 << 15
    counters = torch.arange(n)
    one_seed = counter_uniforms(seed_keys([1234] * n), counters)  # one stream, counters 0..n-1
    _check_uniform(one_seed)
    _check_independent(one_seed[:-1], one_seed[1:])
    _check_independent(one_seed[:-2], one_seed[2:])
    seeds = list(range(2**31 - 100, 2**31 - 100 + n))  # the trainer's seeds are consecutive ints like these
    same_counter = counter_uniforms(seed_keys(seeds), torch.full((n,), 40))
    _check_uniform(same_counter)
    _check_independent(same_counter[:-1], same_counter[1:])
    next_counter = counter_uniforms(seed_keys(seeds), torch.full((n,), 41))
    _check_independent(same_counter, next_counter)
    diagonal = counter_uniforms(seed_keys(seeds[1:]), torch.full((n - 1,), 40) ^ 1)  # seed + 1, counter ^ 1
    _check_independent(same_counter[:-1], diagonal)


def _filtered_softmax(logits, temperature, top_k, top_p):
    warped = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    warped = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, warped))
    return warped.softmax(-1)[0].double()


@pytest.mark.parametrize("over", ["seeds", "counters"])
def test_seeded_draws_follow_the_filtered_softmax(over):
    """Chi-square over 30000 draws, of many seeds at one counter or of one seed at many counters; a token the
    filters drop is never drawn, though the dropped ones sit at both ends of the vocabulary."""
    logits = torch.randn(24, generator=_shared(5)) * 1.5
    logits[0] = logits[-1] = -5.0
    temperature, top_k, top_p = 0.8, 14, 0.97
    probs = _filtered_softmax(logits, temperature, top_k, top_p)
    kept = probs > 0
    assert 3 < int(kept.sum()) < 14 and not kept[0] and not kept[-1]
    n = 30000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)] * n
    seeds, counters = (list(range(n)), _counters(n, 11)) if over == "seeds" else ([99] * n, torch.arange(n))
    out = sample(logits.expand(n, -1), _batch(params, seeds, vocab_size=24), counters)
    counts = torch.bincount(out.token_ids, minlength=24).double()
    assert counts[~kept].sum() == 0
    assert _chi2(counts[kept], probs[kept]) < _chi2_critical(int(kept.sum()) - 1)


def test_inverse_cdf_hand_checked_and_never_on_a_zero_weight():
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0, 0.5, 0.0]]).expand(6, -1)  # cumulative 0 .5 .5 .5 1.5 2 2
    uniforms = torch.tensor([0.0, 0.2, 0.25, 0.75, 1 - 2**-24, 1.0])
    # u * 2 = 0, .4, .5, 1.5, just below 2: the first token whose cumulative weight is above it (the zero weights
    # in between are passed over); u = 1, outside [0, 1), lands past the end, clamped onto a zero weight: fallback.
    got = inverse_cdf(weights, uniforms, fallback=torch.full((6,), 4))
    assert got.tolist() == [1, 1, 4, 5, 5, 4]


def test_seeded_token_is_independent_of_the_batch_and_its_row():
    logits = torch.randn(6, 40, generator=_shared(3))
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), SamplingParams(temperature=1.3, seed=7),
              SamplingParams(temperature=0.5, top_p=0.8, raw_logprobs=True), SamplingParams()]
    alone = sample(logits[:1], _batch([target], [42], 40), _counters(1, 17)).token_ids.item()
    for row in range(6):  # the target's logits at every row of a full batch, the others' settings around it
        params = others[:row] + [target] + others[row:]
        seeds = [7 if p.seed == 7 else None for p in params]
        seeds[row] = 42
        rows = torch.cat([logits[1:row + 1], logits[:1], logits[row + 1:]])
        for shared in (0, 1):
            out = sample(rows, _batch(params, seeds, 40), _counters(6, 17), _shared(shared))
            assert out.token_ids[row].item() == alone, (row, shared)
    over_counters = sample(logits[:1].expand(40, -1), _batch([target] * 40, [42] * 40, 40), torch.arange(40))
    assert len(set(over_counters.token_ids.tolist())) > 3  # the counter really changes the draw


def test_fixed_buffers_sample_what_the_batch_samples():
    """The CUDA-graph path on CPU: settings and seeds loaded into the buffers, read through a padded view."""
    logits = torch.randn(8, 40, generator=_shared(6))
    params = [SamplingParams(temperature=0.7, top_k=9, seed=s) for s in range(3)] + [SamplingParams(top_p=0.8)]
    batch = _batch(params, [0, 1, 2, None], 40)
    buffers = SamplingBuffers(8, 40, CPU)
    buffers.load(_batch([SamplingParams(temperature=0.0)] * 8, [5] * 8, 40))  # stale settings in every row
    buffers.load(batch)
    counters = torch.arange(8) * 3
    direct = sample(logits[:4], batch, counters[:4])
    fixed = sample(logits, buffers.view(batch, 8), counters)
    assert torch.equal(fixed.token_ids[:3], direct.token_ids[:3])  # the seeded rows
    assert torch.equal(fixed.logprobs[:3], direct.logprobs[:3])
    expected = [reference_draw((logits[i] / 0.7).tolist(), reference_uniform(i, 3 * i), top_k=9) for i in range(3)]
    assert fixed.token_ids[:3].tolist() == expected


def test_empirical_frequencies_match_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num_rows = 20000
    out = sample(probs.log().expand(num_rows, -1), _batch([SamplingParams()] * num_rows, vocab_size=4),
                 _counters(num_rows), _shared())
    freq = torch.bincount(out.token_ids, minlength=4).float() / num_rows
    assert torch.allclose(freq, probs, atol=0.012)  # standard error <= 0.0036


def test_unit_temperature_bf16_logits_give_the_fp32_result_bit_for_bit():
    # The temperature-1 path uses bf16 logits as they are; the reference is the fp32 pipeline written out here.
    logits = (3 * torch.randn(6, 300, generator=_shared(4))).bfloat16()
    scaled = logits.float()
    seeds, counters = [11, 12, 13, 14, 15, 16], torch.arange(6) + 20
    uniforms = torch.tensor([reference_uniform(s, c) for s, c in zip(seeds, counters.tolist())])
    cdf = (scaled - scaled.max(-1, keepdim=True).values).exp().cumsum(-1)
    expected_tokens = (cdf <= (uniforms[:, None] * cdf[:, -1:])).sum(-1)  # the first index above u * total
    normaliser = torch.logsumexp(scaled, -1)
    out = sample(logits, _batch([SamplingParams(raw_logprobs=True)] * 6, seeds, 300), counters)
    assert torch.equal(out.token_ids, expected_tokens)
    expected_logprobs = scaled.gather(1, expected_tokens[:, None]).squeeze(1) - normaliser
    assert torch.equal(out.logprobs, expected_logprobs) and torch.equal(out.raw_logprobs, expected_logprobs)
    greedy = sample(logits, _batch([SamplingParams(temperature=0.0)] * 6, vocab_size=300), counters)
    assert torch.equal(greedy.token_ids, scaled.argmax(-1))
    assert torch.equal(greedy.logprobs, scaled.max(-1).values - normaliser)


def test_invalid_params_name_the_field():
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)
