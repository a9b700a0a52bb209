"""Top-k distillation over vocab blocks split by TP (verl's `forward_kl_topk`): the teacher's k most likely tokens per
position, and the student's forward KL on them, KL_k(teacher || student) = sum over the teacher's top k of
p_t(i) * (log p_t(i) - log p_s(i)), with both log-probs normalised over the whole vocabulary.

Neither side gathers the vocabulary: the teacher's top k are each rank's top k, all-gathered ([T, tp * k]) and cut to
k; the student's log-probs at the teacher's ids come from its log normaliser (two small all-reduces, as the logprob
maths of `vocab.py`) plus the logit held by the rank whose block holds each id.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardrl.parallel.collectives import all_gather_single
from shardrl.parallel.tensor import Group, group_size
from shardrl.parallel.vocab import (
    LOGPROB_CHUNK_ELEMENTS,
    held_values,
    local_columns,
    real_columns,
    softmax_normaliser,
    token_chunks,
)


@torch.no_grad()
def vocab_parallel_topk(logits: Tensor, k: int, group: Group, vocab_size: int,
                        chunk_elements: int = LOGPROB_CHUNK_ELEMENTS) -> tuple[Tensor, Tensor]:
    """logits [T, Vp/tp] (this rank's block) -> (log-probs [T, k] fp32, global token ids [T, k] int64) of the k
    most likely real tokens of each position, most likely first; the same on every TP rank. k <= vocab_size."""
    z, start = real_columns(logits, group, vocab_size)  # [T, V'/tp]
    log_norm, _, _ = softmax_normaliser(z, group, chunk_elements)
    values, ids = _top_logits(z, start, k, group)
    return values - log_norm.unsqueeze(-1), ids


@torch.no_grad()
def vocab_parallel_topk_ids(logits: Tensor, k: int, group: Group, vocab_size: int) -> Tensor:
    """The global ids [T, k] int64 of each position's k largest real logits (its most likely tokens), most likely
    first; the same on every TP rank. No normaliser: for the student's top k beside the teacher's (a metric)."""
    z, start = real_columns(logits, group, vocab_size)  # [T, V'/tp]
    return _top_logits(z, start, k, group)[1]


def _top_logits(z: Tensor, start: int, k: int, group: Group) -> tuple[Tensor, Tensor]:
    """(logits [T, k] fp32, global ids [T, k]) of the k largest of every row over the TP ranks' blocks."""
    num_tokens, local_k = z.shape[0], min(k, z.shape[1])
    values = torch.full((num_tokens, k), float("-inf"), device=z.device)  # [T, k] fewer columns than k: -inf
    ids = torch.zeros(num_tokens, k, dtype=torch.int64, device=z.device)
    if local_k:
        top = z.topk(local_k, dim=-1)
        values[:, :local_k], ids[:, :local_k] = top.values.float(), top.indices + start
    if group is not None:
        ranks = group_size(group)
        gathered = torch.empty(ranks, num_tokens, 2 * k, dtype=torch.float64, device=z.device)
        # one all-gather of both (ids below 2**53 are exact in float64)
        all_gather_single(gathered, torch.cat([values, ids], dim=-1).double().unsqueeze(0), group=group)
        values = gathered[..., :k].permute(1, 0, 2).reshape(num_tokens, ranks * k).float()  # [T, tp * k]
        ids = gathered[..., k:].permute(1, 0, 2).reshape(num_tokens, ranks * k).long()
        top = values.topk(k, dim=-1)
        values, ids = top.values, ids.gather(-1, top.indices)
    return values, ids


def vocab_parallel_topk_kl(logits: Tensor, teacher_log_probs: Tensor, teacher_ids: Tensor, group: Group,
                           vocab_size: int, log_prob_min_clamp: float | None = None,
                           chunk_elements: int = LOGPROB_CHUNK_ELEMENTS) -> tuple[Tensor, Tensor, Tensor]:
    """The student's logits [T, Vp/tp] (this rank's block), the teacher's top-k log-probs and global ids [T, k] ->
    (KL_k(teacher || student) [T] fp32, differentiable in the logits; the student's probability mass on the teacher's
    top k [T] and each of those ids' term p_t (log p_t - log p_s) of the KL [T, k], metrics). With
    `log_prob_min_clamp` both log-probs are clamped below at it first, and a student log-prob at or below it passes
    no gradient (verl's). The same on every TP rank."""
    return _TopKForwardKL.apply(logits, teacher_log_probs, teacher_ids, group, vocab_size, log_prob_min_clamp,
                                chunk_elements)


class _TopKForwardKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, teacher_log_probs: Tensor, teacher_ids: Tensor, group: Group, vocab_size: int,
                log_prob_min_clamp: float | None, chunk_elements: int) -> tuple[Tensor, Tensor, Tensor]:
        z, start = real_columns(logits, group, vocab_size)  # [T, V'/tp]
        index, mine = local_columns(teacher_ids, start, z.shape[1])  # [T, k] each
        log_norm, _, student_z = softmax_normaliser(z, group, chunk_elements, held_values(z, index, mine))
        student = student_z - log_norm.unsqueeze(-1)  # [T, k] log p_s at the teacher's ids
        teacher = teacher_log_probs.float()
        student_mass = student.exp().sum(-1)  # [T]
        active = torch.ones_like(mine)
        if log_prob_min_clamp is not None:
            active = student > log_prob_min_clamp  # a clamped log-prob is a constant: no gradient
            student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
        teacher_probs = teacher.exp()  # [T, k]
        terms = teacher_probs * (teacher - student)  # [T, k]
        ctx.save_for_backward(logits, log_norm, index, mine, torch.where(active, teacher_probs, 0.0))
        ctx.num_valid, ctx.chunk_elements = z.shape[1], chunk_elements
        ctx.mark_non_differentiable(student_mass, terms)
        ctx.set_materialize_grads(False)
        return terms.sum(-1), student_mass, terms

    @staticmethod
    def backward(ctx, grad_kl: Tensor | None, _grad_mass: None, _grad_terms: None):
        if grad_kl is None:
            return (None,) * 7
        logits, log_norm, index, mine, weights = ctx.saved_tensors
        # d KL / d z_j = p_s(j) * sum_i w_i - w_j (j among the teacher's ids), w = p_t where the student is active
        total = weights.sum(-1) * grad_kl  # [T]
        local = torch.where(mine, weights * grad_kl.unsqueeze(-1), 0.0)  # [T, k] the ids this rank holds
        grad = torch.zeros_like(logits)  # [T, V/tp]; padded columns stay 0
        num_valid = ctx.num_valid
        for lo, hi in token_chunks(logits.shape[0], num_valid, ctx.chunk_elements) if num_valid else []:
            g = (logits[lo:hi, :num_valid] - log_norm[lo:hi, None]).exp_().mul_(total[lo:hi, None])  # [C, V'] fp32
            g.scatter_add_(-1, index[lo:hi], -local[lo:hi])
            grad[lo:hi, :num_valid] = g
        return grad, None, None, None, None, None, None
