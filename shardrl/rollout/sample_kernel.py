"""`sampler.sample` for unfiltered batches on CUDA in two Triton launches: the portable path's maths, one read of the
logits instead of five passes over [B, V].

Why: at the bench shape (256 rows, a 151,936-token vocabulary) the portable ops read the bf16 logits twice and write
and read an fp32 copy three times (max, exp, sum, cumsum's read and write, searchsorted), and the seeded rows'
uniforms are some twenty tiny kernels on [B] tensors; each full pass costs about what a GEMM of the step does.

Launch 1, program (row, chunk of CHUNK tokens): the chunk's max of the (temperature-scaled) logits, its first argmax
and its sum of exp(z - chunk max), and with RAW the same two of the unscaled logits. Launch 2, program (row): the
row's max M, its total weight (each chunk's sum rescaled to M) and normaliser, its uniform (the counter hash of
seeded rows, exact integer maths as `counter_uniforms`; the shared generator's draw otherwise), the chunk whose
running total first exceeds u * total, and inside it, rescanned with weights exp(z - M), the first token whose
running weight exceeds what is left: the inverse CDF of `inverse_cdf`, summed in another order (a draw can move to
a neighbouring token when u lands within rounding of a boundary). As there, a pick of zero weight falls back to the
row's argmax, and greedy rows take the argmax. Rows are independent: a row's result does not depend on its batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 4096  # tokens per program of the first launch (151,936 tokens: 38 chunks per row)


@triton.jit
def _low_word(x):
    """x & 0xFFFFFFFF of a non-negative int64 (truncated to 32 bits, zero-extended back)."""
    return x.to(tl.uint32).to(tl.int64)


@triton.jit
def _mix(x):
    """`sampler._mix` on int64 values in [0, 2**32) (its multipliers below 2**31: no product overflows)."""
    x = x ^ (x >> 16)
    x = _low_word(x * 0x51FB3371)
    x = x ^ (x >> 15)
    x = _low_word(x * 0x4744B533)
    return x ^ (x >> 16)


@triton.jit
def _chunk_stats_kernel(logits_ptr, stride_row, temperature_ptr, stats_ptr, best_ptr, vocab_size, num_chunks,
                        CHUNK: tl.constexpr, SCALE: tl.constexpr, RAW: tl.constexpr):
    """stats [4, B, C] fp32: chunk max and sum of exp(z - max) of the scaled logits, then of the raw ones (RAW);
    best [B, C] int32: the chunk's first argmax (a vocabulary index)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    tokens = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = tokens < vocab_size
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + tokens, mask=valid, other=float("-inf")).to(tl.float32)
    z = tl.div_rn(x, tl.load(temperature_ptr + row)) if SCALE else x
    top = tl.max(z, axis=0)
    first = tl.min(tl.where(z == top, tokens, vocab_size), axis=0)  # the first index holding the max
    at = row * num_chunks + chunk
    plane = tl.num_programs(0) * num_chunks
    shift = tl.where(top == float("-inf"), 0.0, top)  # an all -inf chunk sums to 0, not nan
    tl.store(stats_ptr + at, top)
    tl.store(stats_ptr + plane + at, tl.sum(tl.exp(z - shift), axis=0))
    tl.store(best_ptr + at, first)
    if RAW:
        raw_top = tl.max(x, axis=0)
        raw_shift = tl.where(raw_top == float("-inf"), 0.0, raw_top)
        tl.store(stats_ptr + 2 * plane + at, raw_top)
        tl.store(stats_ptr + 3 * plane + at, tl.sum(tl.exp(x - raw_shift), axis=0))


@triton.jit
def _row_normaliser(stats_ptr, row, num_chunks, plane_offset, plane, BLOCK_C: tl.constexpr):
    """-> (per-chunk weights rescaled to the row max [BLOCK_C], the row max with +-inf as 0, log total + that)."""
    chunks = tl.arange(0, BLOCK_C)
    in_row = chunks < num_chunks
    at = stats_ptr + plane_offset + row * num_chunks + chunks
    tops = tl.load(at, mask=in_row, other=float("-inf"))
    sums = tl.load(at + plane, mask=in_row, other=0.0)
    top = tl.max(tops, axis=0)
    top = tl.where(tl.abs(top) == float("inf"), 0.0, top)  # as `unnormalised_probs`
    weights = tl.where(in_row, sums * tl.exp(tops - top), 0.0)
    return weights, top, tl.log(tl.sum(weights, axis=0)) + top


@triton.jit
def _draw_kernel(logits_ptr, stride_row, temperature_ptr, greedy_ptr, has_seed_ptr, keys_ptr, stride_keys, counters_ptr,
                 drawn_ptr, stats_ptr, best_ptr, token_ptr, logprob_ptr, raw_ptr, vocab_size, num_chunks,
                 num_rows, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, SCALE: tl.constexpr, RAW: tl.constexpr,
                 SAMPLED: tl.constexpr):
    row = tl.program_id(0)
    plane = num_rows * num_chunks
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    chunks = tl.arange(0, BLOCK_C)
    in_row = chunks < num_chunks
    weights, top, normaliser = _row_normaliser(stats_ptr, row, num_chunks, 0, plane, BLOCK_C)
    tops = tl.load(stats_ptr + row * num_chunks + chunks, mask=in_row, other=float("-inf"))
    firsts = tl.load(best_ptr + row * num_chunks + chunks, mask=in_row, other=vocab_size)
    best = tl.min(tl.where(tops == tl.max(tops, axis=0), firsts, vocab_size), axis=0)
    best = tl.minimum(best, vocab_size - 1)
    temperature = tl.load(temperature_ptr + row) if SCALE else 1.0
    token = best.to(tl.int64)
    if SAMPLED:
        if tl.load(greedy_ptr + row) == 0:
            if tl.load(has_seed_ptr + row) != 0:  # `counter_uniforms`
                counter = tl.load(counters_ptr + row)
                hashed = _mix(_mix(counter ^ tl.load(keys_ptr + row)) ^ tl.load(keys_ptr + stride_keys + row))
                u = (hashed >> 8).to(tl.float32) * (1.0 / 16777216.0)
            else:
                u = tl.load(drawn_ptr + row)
            threshold = u * tl.sum(weights, axis=0)
            running = tl.cumsum(weights, axis=0)  # [BLOCK_C]
            hit = tl.min(tl.where((running > threshold) & (weights > 0), chunks, BLOCK_C), axis=0)
            last = tl.max(tl.where(weights > 0, chunks, -1), axis=0)
            chunk = tl.where(hit < BLOCK_C, hit, last)  # rounding can leave u * total past the sum of the chunks
            if chunk >= 0:
                left = threshold - tl.sum(tl.where(chunks < chunk, weights, 0.0), axis=0)
                offsets = tl.arange(0, CHUNK)
                tokens = chunk * CHUNK + offsets
                valid = tokens < vocab_size
                x = tl.load(logits_row + tokens, mask=valid, other=float("-inf")).to(tl.float32)
                z = tl.div_rn(x, temperature) if SCALE else x
                w = tl.exp(z - top)  # [CHUNK], as the portable path's weights
                cumulative = tl.cumsum(w, axis=0)
                pick = tl.min(tl.where((cumulative > left) & (w > 0), offsets, CHUNK), axis=0)
                pick = tl.where(pick < CHUNK, pick, tl.max(tl.where(w > 0, offsets, -1), axis=0))
                token = tl.where(pick >= 0, chunk * CHUNK + pick, best).to(tl.int64)
    x_token = tl.load(logits_row + token).to(tl.float32)
    z_token = tl.div_rn(x_token, temperature) if SCALE else x_token
    logprob = z_token - normaliser
    tl.store(token_ptr + row, token)
    tl.store(logprob_ptr + row, logprob)
    if RAW:
        _, _, raw_normaliser = _row_normaliser(stats_ptr, row, num_chunks, 2 * plane, plane, BLOCK_C)
        tl.store(raw_ptr + row, x_token - raw_normaliser)
    else:
        tl.store(raw_ptr + row, logprob)


def fused_sample(logits: Tensor, temperature: Tensor, greedy: Tensor, has_seed: Tensor, keys: Tensor,
                 counters: Tensor, drawn: Tensor | None, scale: bool, raw: bool
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """logits [B, V] (unit stride over V), per-row settings as `SamplingBatch` holds them, counters [B] int64,
    drawn [B] fp32 (the unseeded rows' uniforms; None when every row is greedy) -> token ids [B] int64, logprobs
    and raw logprobs [B] fp32 (the logprobs again unless `raw` and `scale`). `scale`: divide by the temperature."""
    num_rows, vocab_size = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    device = logits.device
    stats = torch.empty(4, num_rows, num_chunks, dtype=torch.float32, device=device)
    best = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=device)
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
    raw_logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows == 0:
        return token_ids, logprobs, raw_logprobs
    with_raw = raw and scale
    _chunk_stats_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temperature, stats, best, vocab_size, num_chunks, CHUNK=CHUNK, SCALE=scale,
        RAW=with_raw, num_warps=8)
    sampled = drawn is not None
    _draw_kernel[(num_rows,)](
        logits, logits.stride(0), temperature, greedy, has_seed, keys, keys.stride(0), counters,
        drawn if sampled else logprobs, stats, best, token_ids, logprobs, raw_logprobs, vocab_size, num_chunks,
        num_rows, CHUNK=CHUNK, BLOCK_C=max(triton.next_power_of_2(num_chunks), 2), SCALE=scale, RAW=with_raw,
        SAMPLED=sampled, num_warps=8)
    return token_ids, logprobs, raw_logprobs
