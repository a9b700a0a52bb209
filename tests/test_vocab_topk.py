"""Top-k distillation over vocab blocks (`parallel/vocab_topk.py`) against a full-vocab float64 reference: the
teacher's top-k log-probs and ids, and the student's forward KL on them with its gradient, at TP1, TP2 and TP4 on
gloo (vocab padding, a rank of padding only, k larger than a rank's block), with and without the log-prob clamp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.vocab import padded_vocab_size
from shardrl.parallel.vocab_topk import vocab_parallel_topk, vocab_parallel_topk_ids, vocab_parallel_topk_kl

T = 7
TOL = dict(atol=1e-5, rtol=1e-5)
# (vocab, k, chunk elements, clamp): 13 pads to 14 over TP2 and 16 over TP4 (rank 3: one real column), k 5 exceeds
# a TP4 rank's block of 4; one-token chunks; a clamp high enough to cut some of the student's log-probs.
CASES = [(13, 5, 2**26, None), (13, 3, 1, None), (13, 5, 20, -2.5), (13, 13, 2**26, None)]


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(vocab)
    return (torch.randn(T, vocab, generator=g, dtype=torch.float64) * 3,  # student logits
            torch.randn(T, vocab, generator=g, dtype=torch.float64) * 3,  # teacher logits
            torch.randn(T, generator=g, dtype=torch.float64))  # upstream gradient of each token's KL


def _reference(student: torch.Tensor, teacher: torch.Tensor, k: int, clamp: float | None, upstream: torch.Tensor):
    """(teacher top-k log-probs and ids, KL, student mass, the student logits' gradient of sum(KL * upstream), the KL's
    terms per id): top-k of log_softmax, then sum p_t * (log p_t - log p_s) over them, by autograd in float64."""
    teacher_topk, ids = teacher.log_softmax(-1).topk(k, dim=-1)
    full = student.clone().requires_grad_()
    student_lp = full.log_softmax(-1).gather(-1, ids)
    mass = student_lp.detach().exp().sum(-1)
    teacher_lp = teacher_topk
    if clamp is not None:
        student_lp, teacher_lp = student_lp.clamp_min(clamp), teacher_lp.clamp_min(clamp)
    terms = teacher_lp.exp() * (teacher_lp - student_lp)
    kl = terms.sum(-1)
    (kl * upstream).sum().backward()
    return teacher_topk, ids, kl.detach(), mass, full.grad, terms.detach()


def check_against_reference(tp: int) -> int:
    """Every case on this rank; returns the number of checks (so a silent skip shows)."""
    layout = Layout.create(LayoutSpec(world_size=tp, tp=tp)) if tp > 1 else Layout.single()
    checks = 0
    for vocab, k, chunk_elements, clamp in CASES:
        student, teacher, upstream = _inputs(vocab)
        ref_teacher_lp, ref_ids, ref_kl, ref_mass, ref_grad, ref_terms = _reference(student, teacher, k, clamp,
                                                                                    upstream)
        width = padded_vocab_size(vocab, tp)
        # Padded columns hold a huge logit: it would dominate the softmax and the top-k if it were not excluded.
        shard = lambda x: F.pad(x, (0, width - vocab), value=1e4).chunk(tp, dim=-1)[layout.tp_rank].float()
        teacher_lp, ids = vocab_parallel_topk(shard(teacher), k, layout.tp_group, vocab, chunk_elements)
        assert torch.equal(ids, ref_ids), (vocab, k)
        assert_close(teacher_lp, ref_teacher_lp.float(), **TOL)
        student_ids = vocab_parallel_topk_ids(shard(student), k, layout.tp_group, vocab)
        assert torch.equal(student_ids, student.topk(k, dim=-1).indices), (vocab, k)
        local = shard(student).requires_grad_()
        kl, mass, terms = vocab_parallel_topk_kl(local, teacher_lp, ids, layout.tp_group, vocab, clamp,
                                                 chunk_elements)
        (kl * upstream.float()).sum().backward()
        assert_close(kl, ref_kl.float(), **TOL)
        assert_close(mass, ref_mass.float(), **TOL)
        assert_close(terms, ref_terms.float(), **TOL)
        expected = F.pad(ref_grad, (0, width - vocab)).chunk(tp, dim=-1)[layout.tp_rank].float()
        assert_close(local.grad, expected, **TOL)
        checks += 1
    return checks


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_topk_and_forward_kl_match_the_full_vocab_reference(tp):
    results = run_distributed(tp, check_against_reference, tp) if tp > 1 else [check_against_reference(1)]
    assert results == [len(CASES)] * tp


def test_the_clamp_stops_the_gradient_of_clamped_student_log_probs():
    """With the clamp above every student log-prob, the KL is a constant: no gradient at all."""
    student, teacher, _ = _inputs(13)
    teacher_lp, ids = vocab_parallel_topk(teacher.float(), 4, None, 13)
    logits = student.float().requires_grad_()
    kl, _, _ = vocab_parallel_topk_kl(logits, teacher_lp, ids, None, 13, log_prob_min_clamp=0.0)
    kl.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_bf16_logits_give_the_fp32_maths_and_a_bf16_gradient():
    student, teacher, upstream = _inputs(13)
    low = student.bfloat16().requires_grad_()
    teacher_lp, ids = vocab_parallel_topk(teacher.bfloat16(), 5, None, 13)
    kl, _, _ = vocab_parallel_topk_kl(low, teacher_lp, ids, None, 13)
    (kl * upstream.float()).sum().backward()
    _, _, ref_kl, _, ref_grad, _ = _reference(low.detach().double(), teacher.bfloat16().double(), 5, None, upstream)
    assert teacher_lp.dtype == kl.dtype == torch.float32 and low.grad.dtype == torch.bfloat16
    assert_close(kl, ref_kl.float(), **TOL)
    assert_close(low.grad, ref_grad.bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_with_a_real_vocabulary_in_bf16():
    """The CUDA path (the Triton softmax statistics, torch's topk and gather) on a 151,936-token vocabulary, the
    student's logits in bf16, against the float64 reference on the same rounded logits (the teacher's in fp32: bf16
    would tie among its top 32, and a tie may order either way)."""
    g = torch.Generator().manual_seed(0)
    vocab, k = 151_936, 32
    student, teacher = (torch.randn(64, vocab, generator=g) * 3 for _ in range(2))
    upstream = torch.randn(64, generator=g, dtype=torch.float64)
    student = student.bfloat16()
    ref_teacher_lp, ref_ids, ref_kl, ref_mass, ref_grad, _ = _reference(student.double(), teacher.double(), k,
                                                                        -12.0, upstream)
    teacher_lp, ids = vocab_parallel_topk(teacher.cuda(), k, None, vocab)
    assert torch.equal(ids.cpu(), ref_ids)
    assert_close(teacher_lp.cpu(), ref_teacher_lp.float(), **TOL)
    logits = student.cuda().requires_grad_()
    kl, mass, _ = vocab_parallel_topk_kl(logits, teacher_lp, ids, None, vocab, -12.0)
    (kl * upstream.float().cuda()).sum().backward()
    assert_close(kl.cpu(), ref_kl.float(), **TOL)
    assert_close(mass.cpu(), ref_mass.float(), **TOL)
    assert logits.grad.dtype == torch.bfloat16
    assert_close(logits.grad.cpu(), ref_grad.bfloat16())
