"""Split-KV decode attention on CUDA (Triton): one query token per row against that row's cached keys.

Why a kernel of our own: flash attention's variable-length kernel, which decode used before, tiles the queries 128
rows at a time, so with one query token per (row, head) each thread block reads its row's keys for a single useful
query row and carries the fixed cost of a 128-row tile; on the async bench's shape (384 rows, ~600 cached tokens,
8 KV heads) it read the cache at ~1.6 TB/s and took 70% of a decode step; this kernel reads it at ~3.9 TB/s
(H200, `bench/decode_attention.py`, docs/benchmarks.md). Here one program takes one (row, KV head, split) and all
the query heads sharing that KV head (grouped-query attention reads each key once for the whole group), walks its
split's tokens in tiles with an online softmax, and, when a row's tokens are split over several programs to fill
the GPU at small batches, a second kernel merges the partial results (flash-decoding). Each row reads only its own
`used` tokens, so a batch mixing short and long sequences pays for the tokens it holds. Possible weak spot: small
batches of long rows (32 rows of ~1,400 tokens, 7 query heads per KV head) timed 0.74x flash's speed in eager calls,
which at that size may measure the host's launch cost rather than the kernels (the bench now replays a graph).

The number of splits depends only on static shapes (rows, KV heads, the length bucket), so a step that uses it is
capturable in a CUDA graph; the kernels are compiled on the graph's eager warm-up run, before capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Cached tokens per tile, 128-aligned and walked last tile first: the blocks in which flash attention's forward (the
# trainer's, and the rollout's prefill) walks a causal row of head_dim <= 64, so that scores and probabilities
# round more alike on both sides. The bf16 rollout-vs-trainer logprob mismatch of tests/test_logprob_mismatch_gpu.py
# (one sampled batch each): 64-token tiles walked forwards mean |diff| 0.040, KL k3 0.0017; this 0.030 / 0.0012;
# flash's kernel 0.024 / 0.0010.
BLOCK_N = 128
WAVES = 2  # splits are added until the programs fill the GPU this many times over


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, used_ptr, out_ptr, acc_ptr, stats_ptr, scale,
                    stride_q_row, stride_q_head, stride_k_slot, stride_k_token, stride_k_head,
                    stride_o_row, stride_o_head,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLIT_TOKENS: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Program (row, kv_head, split): attention of the row's GROUP query heads over tokens [split * SPLIT_TOKENS,
    min((split + 1) * SPLIT_TOKENS, used[row])). One split writes the normalised output; several write their
    unnormalised sums and (max, denominator) for `_merge_kernel`."""
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    used = tl.load(used_ptr + row)
    start = split * SPLIT_TOKENS
    end = tl.minimum(start + SPLIT_TOKENS, used)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # [BLOCK_G] this program's query heads
    g_valid, d_valid = g < GROUP, d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=g_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    kv_offset = row * stride_k_slot + kv_head * stride_k_head
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the scores
    l = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # running sum of exp(score - m) * v
    num_tiles = tl.cdiv(end - start, BLOCK_N)
    for i in range(0, num_tiles):  # last tile first, as flash attention walks a causal row (see BLOCK_N)
        tokens = start + (num_tiles - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
        t_valid = tokens < end
        offsets = kv_offset + tokens[:, None] * stride_k_token + d[None, :]  # [BLOCK_N, BLOCK_D]
        load_mask = t_valid[:, None] & d_valid[None, :]
        k = tl.load(k_ptr + offsets, mask=load_mask, other=0.0)
        # Cast back: a compiled caller (torch.compile) passes `scale` as fp64, which would make the product and
        # the running max fp64, a type the loop may not change.
        scores = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)  # [BLOCK_G, BLOCK_N]
        scores = tl.where(t_valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))  # finite: a tile holds at least one valid token
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + offsets, mask=load_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    out_mask = g_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc / l[:, None]
        tl.store(out_ptr + row * stride_o_row + heads[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        slot = (row * GROUP * (tl.num_programs(1)) + heads) * NUM_SPLITS + split  # [BLOCK_G] index of (row, head)
        tl.store(acc_ptr + slot[:, None] * BLOCK_D + d[None, :], acc, mask=out_mask)
        tl.store(stats_ptr + slot * 2, m, mask=g_valid)
        tl.store(stats_ptr + slot * 2 + 1, l, mask=g_valid)


@triton.jit
def _merge_kernel(acc_ptr, stats_ptr, out_ptr, stride_o_row, stride_o_head, num_heads,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """Program (row, head): the softmax-weighted merge of the row's split results (empty splits have max -inf and
    weigh nothing; split 0 always holds a token)."""
    row, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_valid = s < NUM_SPLITS
    slot = (row * num_heads + head) * NUM_SPLITS + s  # [BLOCK_S]
    m = tl.load(stats_ptr + slot * 2, mask=s_valid, other=float("-inf"))
    l = tl.load(stats_ptr + slot * 2 + 1, mask=s_valid, other=0.0)
    acc = tl.load(acc_ptr + slot[:, None] * BLOCK_D + d[None, :], mask=s_valid[:, None] & (d[None, :] < HEAD_DIM),
                  other=0.0)  # [BLOCK_S, BLOCK_D]
    weight = tl.exp(m - tl.max(m, 0))  # [BLOCK_S]
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(out_ptr + row * stride_o_row + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def num_splits_for(num_rows: int, num_kv_heads: int, max_length: int, device: torch.device) -> int:
    """How many programs share one row's tokens: enough to give the GPU `WAVES` programs per SM (small batches of
    long rows), at least one tile each. A function of static shapes only, so a captured graph keeps it."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(WAVES * sms, num_rows * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_length, BLOCK_N)))


def split_kv_decode_attention(q: Tensor, keys: Tensor, values: Tensor, used: Tensor, max_length: int,
                              scale: float) -> Tensor:
    """q [B, nq, D]; keys/values: one layer's cache [S, L, nkv, D] (contiguous, S >= B); used [B] int32 = how many
    cached tokens row b attends to (1 <= used <= max_length <= L) -> [B, nq, D] in q's dtype."""
    q = q.contiguous()  # the kernel steps through head_dim with unit stride (a no-op for the model's q)
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    splits = num_splits_for(num_rows, num_kv_heads, max_length, q.device)
    split_tokens = triton.cdiv(triton.cdiv(max_length, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(max_length, split_tokens)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    out = torch.empty_like(q)
    partial = torch.empty(num_rows * num_heads * splits * block_d if splits > 1 else 0, dtype=torch.float32,
                          device=q.device)  # [B, nq, splits, BLOCK_D] flattened
    stats = torch.empty(num_rows * num_heads * splits * 2 if splits > 1 else 0, dtype=torch.float32,
                        device=q.device)  # [B, nq, splits, (max, denominator)] flattened
    _partial_kernel[(num_rows, num_kv_heads, splits)](
        q, keys, values, used, out, partial, stats, scale,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=BLOCK_N, SPLIT_TOKENS=split_tokens, NUM_SPLITS=splits, num_warps=4, num_stages=2)
    if splits > 1:
        _merge_kernel[(num_rows, num_heads)](
            partial, stats, out, out.stride(0), out.stride(1), num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits))
    return out
