"""Chunked vocab-parallel logprobs/entropy (values and gradients of both) against a full-vocab log_softmax reference,
at TP1 and TP2 on gloo, with token chunks down to one token, vocab padding, and each output's gradient alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.vocab import padded_vocab_size, vocab_parallel_logprobs

T = 9
TOL = dict(atol=1e-6, rtol=1e-6)
# (vocab size, chunk elements): 13 pads to 14 over TP2; 1 over TP2 leaves rank 1 only a padded column;
# 1 element per chunk means one token per chunk, 2**26 one chunk for all tokens.
CASES = [(13, 1), (13, 20), (13, 2**26), (1, 3)]
# Which upstream gradients reach (logprob, entropy): both, logprob only (entropy a metric), entropy only.
UPSTREAM = [(True, True), (True, False), (False, True)]


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(T, vocab, generator=g) * 3  # [T, V]
    targets = torch.randint(0, vocab, (T,), generator=g)
    return logits, targets, torch.randn(T, generator=g), torch.randn(T, generator=g)


def _reference(logits: torch.Tensor, targets: torch.Tensor, up_lp: torch.Tensor | None,
               up_ent: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    full = logits.clone().requires_grad_()
    logp = torch.log_softmax(full, dim=-1)  # [T, V]
    lp, ent = logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    loss = sum((x * up).sum() for x, up in ((lp, up_lp), (ent, up_ent)) if up is not None)
    loss.backward()
    return lp.detach(), ent.detach(), full.grad


def _layout(tp: int) -> Layout:
    return Layout.create(LayoutSpec(world_size=tp, tp=tp)) if tp > 1 else Layout.single()


def _padded(logits: torch.Tensor, vocab: int, tp: int) -> torch.Tensor:
    """The logits with the vocab padding TP adds; padded columns hold a huge logit, which would dominate the softmax
    if it were not excluded."""
    return F.pad(logits, (0, padded_vocab_size(vocab, tp) - vocab), value=1e4)


def check_against_reference(tp: int) -> int:
    """Every case and upstream choice on this rank; returns the number of checks (so a silent skip shows)."""
    layout = _layout(tp)
    checks = 0
    for vocab, chunk_elements in CASES:
        logits, targets, up_lp, up_ent = _inputs(vocab)
        padded = _padded(logits, vocab, tp)
        for use_lp, use_ent in UPSTREAM:
            ref_lp, ref_ent, ref_grad = _reference(logits, targets, up_lp if use_lp else None,
                                                   up_ent if use_ent else None)
            local = padded.chunk(tp, dim=-1)[layout.tp_rank].clone().requires_grad_()  # [T, Vp/tp]
            lp, ent = vocab_parallel_logprobs(local, targets, layout.tp_group, vocab, chunk_elements)
            loss = sum((x * up).sum() for x, up, use in ((lp, up_lp, use_lp), (ent, up_ent, use_ent)) if use)
            loss.backward()
            assert_close(lp, ref_lp, **TOL)
            assert_close(ent, ref_ent, **TOL)
            expected = F.pad(ref_grad, (0, padded.shape[1] - vocab)).chunk(tp, dim=-1)[layout.tp_rank]
            assert_close(local.grad, expected, **TOL)
            checks += 1
    return checks


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_vocab_logprobs_match_log_softmax(tp):
    results = run_distributed(tp, check_against_reference, tp) if tp > 1 else [check_against_reference(1)]
    assert results == [len(CASES) * len(UPSTREAM)] * tp


def test_no_grad_path_and_bf16_logits():
    """Under no_grad (compute_log_prob) nothing is saved for backward; bf16 logits give the fp32 maths of their
    values and a bf16 gradient."""
    logits, targets, up_lp, up_ent = _inputs(13)
    with torch.no_grad():
        lp, ent = vocab_parallel_logprobs(logits, targets, None, 13, 20)
    ref_lp, ref_ent, _ = _reference(logits, targets, up_lp, up_ent)
    assert_close(lp, ref_lp, **TOL)
    assert_close(ent, ref_ent, **TOL)
    low = logits.bfloat16().requires_grad_()
    lp, ent = vocab_parallel_logprobs(low, targets, None, 13, 20)
    (lp * up_lp + ent * up_ent).sum().backward()
    ref_lp, ref_ent, ref_grad = _reference(low.detach().float(), targets, up_lp, up_ent)
    assert lp.dtype == ent.dtype == torch.float32 and low.grad.dtype == torch.bfloat16
    assert_close(lp, ref_lp, **TOL)
    assert_close(ent, ref_ent, **TOL)
    assert_close(low.grad, ref_grad.bfloat16())


def check_sum_squared_probs(tp: int) -> int:
    from shardrl.parallel.vocab import vocab_parallel_sum_squared_probs

    layout = _layout(tp)
    checks = 0
    for vocab, chunk_elements in CASES:
        logits, _, _, _ = _inputs(vocab)
        local = _padded(logits, vocab, tp).chunk(tp, dim=-1)[layout.tp_rank]
        got = vocab_parallel_sum_squared_probs(local, layout.tp_group, vocab, chunk_elements)
        assert_close(got, logits.double().softmax(-1).square().sum(-1).float(), **TOL)
        checks += 1
    return checks


@pytest.mark.parametrize("tp", [1, 2])
def test_sum_of_squared_probabilities_over_the_vocab_blocks(tp):
    """The optimal token baseline's sum over the vocabulary of pi^2, vocab-parallel, against softmax in float64."""
    results = run_distributed(tp, check_sum_squared_probs, tp) if tp > 1 else [check_sum_squared_probs(1)]
    assert results == [len(CASES)] * tp
