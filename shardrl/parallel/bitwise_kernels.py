"""Batch-invariant Triton kernels (bitwise mode, `bitwise.py`): every output element is computed by the same
instructions in the same order whatever else is in the batch, so the rollout engine (decode one token at a time,
prefill whole prompts, CUDA graphs, padding rows) and the trainer (packed micro batches of any size) get the same
bits for the same token.

What makes each one invariant:
* GEMM (`matmul`): no split-K; an output element is the sum over the K dimension in BLOCK_K steps from 0 upward,
  computed in the program that owns its tile, which depends on nothing but its row and column (the tile shape
  changes which elements a program computes, not how each is summed). Rows of different experts (the grouped form,
  MoE) never share a tile's output. The batch size is not specialised (`do_not_specialize`), so M = 1 compiles to
  the same code as M = 4096.
* RMSNorm: one program per row, the whole row in one block.
* Attention: one program per (tile, KV head), a tile's rows being (query, head of the group) pairs; every row walks
  its keys in BLOCK_N blocks from position 0 with one online-softmax update per block. A decode query (one row of a tile) and the same query inside a prefill or
  training tile see the same blocks in the same order; blocks past a row's own position add exactly 0 (p = 0,
  rescale 1), so how far its tile's last row reaches does not change its bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# GEMM tile configurations (BLOCK_M, BLOCK_N, warps, stages), all with BLOCK_K = 64: the K steps, hence every
# element's order of additions, are the same in each, and on H200 their bits are equal (tests/test_bitwise_gpu.py
# checks it); the small one serves decode-sized batches, the large one the rest.
BLOCK_K = 64
SMALL_GEMM, LARGE_GEMM = (64, 64, 4, 4), (128, 128, 8, 3)
ATTN_BLOCK_M, ATTN_BLOCK_N, ATTN_WARPS = 16, 64, 4


@triton.jit(do_not_specialize=["num_rows"])
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr,
                   num_rows, num_cols, depth, num_experts, stride_xm, stride_we, stride_wn, stride_ym,
                   GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Program (row tile, column tile): y[rows, cols] = x[rows] @ w[e][cols]^T (+ bias), fp32 accumulation.

    Dense: tile t holds rows t*BLOCK_M.. of expert 0. Grouped: tile t holds rows tile_row[t].. of expert
    tile_expert[t] (up to that expert's end row); a tile past the last one (tile_expert == number of experts)
    does nothing. Rows and columns past the ends are read clamped (a row never affects another) and not stored;
    only the batch size is left unspecialised (the model's sizes are the same in every call)."""
    tile = tl.program_id(0)
    if GROUPED:
        expert = tl.load(tile_expert_ptr + tile)
        if expert >= num_experts:
            return
        first = tl.load(tile_row_ptr + tile)
        end = tl.load(expert_end_ptr + expert)
    else:
        expert = 0
        first = tile * BLOCK_M
        end = num_rows
    rows = first + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + tl.minimum(rows, num_rows - 1).to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_tile = (w_ptr + expert.to(tl.int64) * stride_we
              + tl.minimum(cols, num_cols - 1).to(tl.int64)[:, None] * stride_wn + ks[None, :])  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, depth, BLOCK_K):
        k_ok = start + ks < depth
        a = tl.load(x_tile, mask=k_ok[None, :], other=0.0)
        b = tl.load(w_tile, mask=k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    col_ok = cols < num_cols
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows < end)[:, None] & col_ok[None, :])


def _rows_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _gemm_config(num_rows: int) -> tuple[int, int, int, int]:
    return SMALL_GEMM if num_rows <= SMALL_GEMM[0] else LARGE_GEMM


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           config: tuple[int, int, int, int] | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype; `config` overrides the tile choice (tests)."""
    x, weight = _rows_contiguous(x), _rows_contiguous(weight)
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    y = x.new_empty(num_rows, num_cols)
    if num_rows and num_cols:
        block_m, block_n, warps, stages = config or _gemm_config(num_rows)
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_cols, block_n))
        _matmul_kernel[grid](x, weight, bias if bias is not None else weight, y, x, x, x, num_rows, num_cols, depth,
                             0, x.stride(0), 0, weight.stride(0), y.stride(0), GROUPED=False,
                             HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                             num_warps=warps, num_stages=stages)
    return y


def grouped_matmul(x: Tensor, weights: Tensor, counts: Tensor) -> Tensor:
    """x [R, K] (rows of expert 0, then expert 1, ...), weights [E, N, K], counts [E] rows per expert ->
    [R, N], row r through its expert's weight. The tile map is built on the device (no host read: CUDA graphs and
    no sync), for the most tiles any split of R rows over E experts needs."""
    x = _rows_contiguous(x)
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    num_rows, depth = x.shape
    num_experts, num_cols, _ = weights.shape
    y = x.new_empty(num_rows, num_cols)
    if not num_rows or not num_cols:
        return y
    block_m, block_n, warps, stages = _gemm_config(num_rows)
    max_tiles = triton.cdiv(num_rows, block_m) + num_experts
    expert_end = counts.cumsum(0)  # [E]
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_end = tiles.cumsum(0)
    tile_ids = torch.arange(max_tiles, device=x.device)
    tile_expert = torch.searchsorted(tile_end, tile_ids, right=True)  # [max_tiles]; E: no tile
    expert = tile_expert.clamp(max=num_experts - 1)
    tile_row = expert_end[expert] - counts[expert] + (tile_ids - (tile_end[expert] - tiles[expert])) * block_m
    grid = (max_tiles, triton.cdiv(num_cols, block_n))
    _matmul_kernel[grid](x, weights, weights, y, tile_expert, tile_row, expert_end, num_rows, num_cols, depth,
                         num_experts, x.stride(0), weights.stride(0), weights.stride(1), y.stride(0), GROUPED=True,
                         HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=warps,
                         num_stages=stages)
    return y


@triton.jit(do_not_specialize=["num_cols"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, num_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    """Program row: y = w * (x / sqrt(mean(x^2) + eps) rounded to x's dtype), HF's order of roundings."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / num_cols + eps)
    normed = (x * inv).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=inside)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., H] -> the same shape, normalised per row of H."""
    rows = _rows_contiguous(x).reshape(-1, x.shape[-1])
    y = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, y, rows.shape[1], rows.stride(0), y.stride(0), eps,
                                           BLOCK=triton.next_power_of_2(rows.shape[1]), num_warps=4)
    return y.view(x.shape)


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, q_start_ptr, q_len_ptr, q_pos_ptr, k_start_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                      scale_log2, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Program (sequence, tile, KV head): tile row r is query r // GROUP of the sequence in query head
    kv_head * GROUP + r % GROUP (the heads sharing the KV head read its keys once); query i sits at position
    q_pos + i and attends to keys 0..q_pos + i of the sequence's key store (rows k_start.. of k and v)."""
    seq, tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(q_len_ptr + seq)
    if tile * BLOCK_M >= q_len * GROUP:
        return
    q_start = tl.load(q_start_ptr + seq).to(tl.int64)
    q_pos = tl.load(q_pos_ptr + seq)
    k_start = tl.load(k_start_ptr + seq).to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    queries = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = queries < q_len
    positions = q_pos + queries
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + queries)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_rows, mask=row_ok[:, None], other=0.0)
    last = q_pos + tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)  # the tile's furthest position
    running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys <= last
        k = tl.load(k_ptr + (k_start + keys)[None, :] * stride_kt + kv_head * stride_kh + dims[:, None],
                    mask=key_ok[None, :], other=0.0)  # [D, BLOCK_N]
        scores = tl.dot(q, k) * scale_log2
        scores = tl.where(keys[None, :] <= positions[:, None], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # finite: key 0 is in every row's first block
        rescale = tl.exp2(running_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (k_start + keys)[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                    mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max
    out = acc / total[:, None]
    o_rows = (q_start + queries)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(o_ptr + o_rows, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def attention(q: Tensor, keys: Tensor, values: Tensor, q_start: Tensor, q_len: Tensor, q_pos: Tensor,
              k_start: Tensor, max_q_len: int, scale: float) -> Tensor:
    """Causal attention of packed queries q [T, nq, D] against key/value stores [R, nkv, D] (row stride free).

    Sequence b's queries are rows q_start[b].. (q_len[b] of them) at positions q_pos[b].., and its keys and
    values at positions 0.. are rows k_start[b].. of the stores (int32 [N] each, on the device). `max_q_len`
    bounds q_len (the grid). Training and fresh prefill: the stores are the packed k and v themselves; the engine's
    cache: a slot's rows."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    num_seqs = q_len.shape[0]
    if not num_seqs or not q.shape[0]:
        return out
    group = num_heads // keys.shape[1]
    grid = (num_seqs, triton.cdiv(max_q_len * group, ATTN_BLOCK_M), keys.shape[1])
    _attention_kernel[grid](q, keys, values, out, q_start, q_len, q_pos, k_start,
                            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0),
                            values.stride(1), out.stride(0), out.stride(1), scale * 1.4426950408889634,
                            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=ATTN_BLOCK_M,
                            BLOCK_N=ATTN_BLOCK_N, num_warps=ATTN_WARPS)
    return out
