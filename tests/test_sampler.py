"""Sampler: hand-computed filtered distributions on a tiny vocab, HF's warpers as reference for top-k/top-p,
seeded reproducibility and batch independence, empirical frequencies."""

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from shardrl.rollout.request import SamplingParams, SamplingParamsError
from shardrl.rollout.sampler import SamplingBatch, filter_top_k_top_p, sample

CPU = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])


def _batch(params, seeds=None):
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * len(params))]
    return SamplingBatch.build(params, generators, vocab_size=LOGITS.numel(), device=CPU)


def test_filtered_logprobs_hand_checked():
    # temperature 0.5 -> [4, 2, 1, -2, 0]; top-k 3 keeps [4, 2, 1] with probs 0.8438, 0.1142, 0.0420;
    # top-p 0.9 keeps tokens whose mass above is < 0.9: tokens 0 (0) and 1 (0.8438), not 2 (0.958).
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=7, raw_logprobs=True)
    expected = {0: -math.log(1 + math.exp(-2.0)), 1: -2.0 - math.log(1 + math.exp(-2.0))}
    num_rows = 4000
    batch = _batch([params] * num_rows, seeds=list(range(num_rows)))
    out = sample(LOGITS.expand(num_rows, -1), batch)
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
    out = sample(logits, SamplingBatch.build(params, [None] * 3, 20, CPU), torch.Generator().manual_seed(0))
    scaled = TemperatureLogitsWarper(0.7)(None, logits[1:2].clone())
    assert out.logprobs[1].item() == pytest.approx(torch.log_softmax(scaled, -1)[0, out.token_ids[1]].item(),
                                                   abs=1e-6)
    for row, t in enumerate((1.0, 0.7, 1.3)):
        expected = torch.log_softmax(logits[row] / t, -1)[out.token_ids[row]]
        assert out.logprobs[row].item() == pytest.approx(expected.item(), abs=1e-6)


def test_greedy_rows_take_argmax_next_to_sampled_rows():
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0, top_k=3),
              SamplingParams(top_p=0.5)]
    out = sample(logits, SamplingBatch.build(params, [None] * 4, 30, CPU), torch.Generator().manual_seed(0))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    assert out.logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0], -1).max().item(), abs=1e-6)
    top3 = logits[2].topk(3).values
    assert out.logprobs[2].item() == pytest.approx((top3[0] - top3.logsumexp(0)).item(), abs=1e-6)


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(5, 40)
    params = [SamplingParams(temperature=1.1, top_p=0.95)] * 5
    seeds = [11, 12, 13, 14, 15]
    together = sample(logits, _batch_for(params, seeds)).token_ids
    again = sample(logits, _batch_for(params, seeds)).token_ids
    assert torch.equal(together, again)
    alone = [sample(logits[i:i + 1], _batch_for(params[:1], [seeds[i]])).token_ids.item() for i in range(5)]
    assert together.tolist() == alone
    other_seeds = sample(logits.repeat(8, 1), _batch_for(params * 8, list(range(100, 140)))).token_ids
    assert len(set(other_seeds.view(8, 5)[:, 0].tolist())) > 1  # the seed really changes the draw


def _batch_for(params, seeds):
    return SamplingBatch.build(params, [torch.Generator().manual_seed(s) for s in seeds], 40, CPU)


def test_empirical_frequencies_match_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num_rows = 20000
    params = [SamplingParams()] * num_rows
    out = sample(probs.log().expand(num_rows, -1), SamplingBatch.build(params, [None] * num_rows, 4, CPU),
                 torch.Generator().manual_seed(0))
    freq = torch.bincount(out.token_ids, minlength=4).float() / num_rows
    assert torch.allclose(freq, probs, atol=0.012)  # standard error <= 0.0036


def test_unit_temperature_bf16_logits_give_the_fp32_result_bit_for_bit():
    # The temperature-1 path uses bf16 logits as they are; the reference is the fp32 pipeline written out here.
    torch.manual_seed(4)
    logits = (3 * torch.randn(6, 300)).bfloat16()
    scaled = logits.float()
    noise = torch.empty(6, 300).exponential_(generator=torch.Generator().manual_seed(9))
    expected_tokens = (scaled - noise.clamp_(min=torch.finfo(torch.float32).tiny).log_()).argmax(-1)
    normaliser = torch.logsumexp(scaled, -1)
    out = sample(logits, SamplingBatch.build([SamplingParams(raw_logprobs=True)] * 6, [None] * 6, 300, CPU),
                 torch.Generator().manual_seed(9))
    assert torch.equal(out.token_ids, expected_tokens)
    expected_logprobs = scaled.gather(1, expected_tokens[:, None]).squeeze(1) - normaliser
    assert torch.equal(out.logprobs, expected_logprobs) and torch.equal(out.raw_logprobs, expected_logprobs)
    greedy = sample(logits, SamplingBatch.build([SamplingParams(temperature=0.0)] * 6, [None] * 6, 300, CPU))
    assert torch.equal(greedy.token_ids, scaled.argmax(-1))
    assert torch.equal(greedy.logprobs, scaled.max(-1).values - normaliser)


def test_invalid_params_name_the_field():
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)
