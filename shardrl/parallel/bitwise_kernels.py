"""Batch-invariant Triton kernels (bitwise mode, `FastPaths.bitwise`): every output element is computed by the same
instructions in the same order whatever else is in the batch, so the rollout engine (decode one token at a time,
prefill whole prompts, CUDA graphs, padding rows) and the trainer (packed micro batches of any size) get the same
bits for the same token.

What makes each one invariant:
* GEMM (`matmul`): no split-K; an output element is the sum over the K dimension in BLOCK_K steps from 0 upward,
  computed in the program that owns its tile, which depends on nothing but its row and column (the tile shape,
  chosen per batch size, changes which elements a program computes, not how each is summed). Rows of different
  experts (the grouped form, MoE) never share a tile's output. The batch size is not specialised
  (`do_not_specialize`), so M = 1 compiles to the same code as M = 4096.
* RMSNorm (`models/norm_kernel.py`): one program per row, the whole row in one block.
* Attention: one program per (tile, KV head), a tile's rows being (query, head of the group) pairs, one tile height
  for every call; every row walks its keys in BLOCK_N blocks from position 0 with one online-softmax update per
  block. A decode query (the first rows of a tile) and the same query inside a prefill or training tile see the same
  blocks in the same order; blocks past a row's own position add exactly 0 (p = 0, rescale 1), so how far its
  tile's last row reaches does not change its bits.

Every kernel launches through `FastKernel` (`triton_launch.py`): a small model's step is host-bound, and Triton's
own launch costs the host about 1.5x cuBLAS's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from shardrl.parallel.triton_launch import FastKernel

# GEMM tile configurations (BLOCK_M, BLOCK_N, warps, stages), all with BLOCK_K = 64: the K steps, hence every
# element's order of additions, are the same in each, and on H200 their bits are equal (tests/test_bitwise_gpu.py
# checks every pair; bench/bitwise_kernels.py every model shape). Largest tile first; `_gemm_config` takes the first
# that keeps the GPU busy, so decode-sized batches get narrow tiles (no split-K to spread them otherwise).
BLOCK_K = 64
GEMM_CONFIGS = ((128, 128, 8, 3), (64, 128, 4, 4), (64, 64, 4, 4), (64, 32, 4, 4), (64, 16, 4, 4),
                (16, 64, 4, 4), (16, 32, 4, 4))
MIN_PROGRAMS = 64  # fewer tiles than this leave H200's 132 SMs idle (bench/bitwise_kernels.py: best tile per shape)
# One tile height for every attention call: decode, prefill and training tiles must lay a query's row out alike
# (other heights change the reduction order of the softmax sums: bench/bitwise_kernels.py prints DIFFER), and 64
# rows are the fastest for prefill and within 3% of the fastest for decode there.
ATTN_BLOCK_M, ATTN_BLOCK_N, ATTN_WARPS = 64, 64, 4


@triton.jit(do_not_specialize=["num_rows"])
def _matmul_kernel(x_ptr, w_ptr, w2_ptr, bias_ptr, y_ptr, y2_ptr, tile_expert_ptr, first_row_ptr, expert_end_ptr,
                   num_rows, num_cols, depth, num_experts, stride_xm, stride_we, stride_wn, stride_ym,
                   GROUPED: tl.constexpr, PAIRED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row tile, column tile): y[rows, cols] = x[rows] @ w[e][cols]^T (+ bias), fp32 accumulation.
    `PAIRED`: the column tiles past w's run a second weight of the same shape and strides, w2, into y2 (an expert
    FFN's gate and up projections in one launch; each tile is computed as it would be alone).

    Dense: tile t holds rows t*BLOCK_M.. of expert 0. Grouped: tile t holds rows first_row[t].. of expert
    tile_expert[t] (up to that expert's end row); a tile past the last one (tile_expert >= the number of experts)
    runs no K steps and stores nothing (no early return, which would keep the K loop from being pipelined). Rows
    and columns past the ends are read clamped (a row never affects another) and not stored; only the batch size
    is left unspecialised (the model's sizes are the same in every call)."""
    tile = tl.program_id(0)
    if GROUPED:
        expert = tl.load(tile_expert_ptr + tile)
        live = expert < num_experts
        expert = tl.minimum(expert, num_experts - 1)
        first = tl.load(first_row_ptr + tile)
        end = tl.where(live, tl.load(expert_end_ptr + expert), 0)
        steps_end = tl.where(live, depth, 0)
    else:
        expert = 0
        first = tile * BLOCK_M
        end = num_rows
        steps_end = depth
    column_tile = tl.program_id(1)
    if PAIRED:
        col_tiles = tl.cdiv(num_cols, BLOCK_N)
        if column_tile >= col_tiles:
            column_tile -= col_tiles
            w_ptr = w2_ptr
            y_ptr = y2_ptr
    rows = first + tl.arange(0, BLOCK_M)
    cols = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + tl.minimum(rows, num_rows - 1).to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_tile = (w_ptr + expert.to(tl.int64) * stride_we
              + tl.minimum(cols, num_cols - 1).to(tl.int64)[:, None] * stride_wn + ks[None, :])  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, steps_end, BLOCK_K):
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


_MATMUL = FastKernel(_matmul_kernel)


def rows_contiguous(x: Tensor) -> Tensor:
    """x, or a copy whose last dimension is contiguous: the kernels step along a row one element at a time."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _block_m(num_rows: int) -> int:
    """Tile height of a dense GEMM: a decode step's few rows fill a 16-row tile, a larger batch 64 or 128."""
    return 16 if num_rows <= 16 else 64 if num_rows <= 64 else 128


@functools.lru_cache(maxsize=4096)
def _gemm_config(num_rows: int, num_cols: int, heights: tuple[int, ...],
                 row_tiles: int | None = None) -> tuple[int, int, int, int]:
    """The largest configuration of a tile height in `heights` whose grid (row tiles x column tiles) reaches
    MIN_PROGRAMS, else the smallest of them. Row tiles: `row_tiles` (a grouped GEMM's tile map: pass num_rows 0),
    else num_rows / the tile height. Cached: a step asks for the same few shapes in every layer."""
    allowed = [c for c in GEMM_CONFIGS if c[0] in heights]
    for config in allowed:
        tiles = row_tiles if row_tiles is not None else triton.cdiv(num_rows, config[0])
        if tiles * triton.cdiv(num_cols, config[1]) >= MIN_PROGRAMS:
            return config
    return allowed[-1]


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           config: tuple[int, int, int, int] | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype; `config` overrides the tile choice (tests)."""
    x, weight = rows_contiguous(x), rows_contiguous(weight)
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    y = x.new_empty(num_rows, num_cols)
    if num_rows and num_cols:
        heights = (128, 64) if num_rows > 64 else (_block_m(num_rows),)
        block_m, block_n, warps, stages = config or _gemm_config(num_rows, num_cols, heights)
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_cols, block_n))
        _MATMUL.launch(grid, (x, weight, weight, bias if bias is not None else weight, y, y, x, x, x),
                       (num_rows, num_cols, depth, 0, x.stride(0), 0, weight.stride(0), y.stride(0)), warps, stages,
                       GROUPED=False, PAIRED=False, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=BLOCK_K)
    return y


@dataclass(frozen=True)
class ExpertTiles:
    """The row tiles of a grouped GEMM (`expert_tiles`): tile t holds rows first_row[t].. of expert expert[t], up
    to expert_end of it; expert[t] >= the number of experts marks a tile past the last. One map serves every GEMM
    over the same rows (an expert FFN's three)."""

    expert: Tensor  # [max_tiles] int32
    first_row: Tensor  # [max_tiles] int32
    expert_end: Tensor  # [E] int32: one past each expert's last row
    block_m: int


@triton.jit(do_not_specialize=["num_experts", "max_tiles"])
def _expert_tiles_kernel(counts_ptr, expert_ptr, first_row_ptr, expert_end_ptr, num_experts, max_tiles,
                         BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program: each expert's rows cut into BLOCK_M tiles, numbered expert by expert."""
    experts = tl.arange(0, EXPERTS)
    present = experts < num_experts
    counts = tl.load(counts_ptr + experts, mask=present, other=0).to(tl.int32)
    ends = tl.cumsum(counts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    row_minus_tile = ends - counts - (tile_ends - tiles) * BLOCK_M  # first row - first tile * BLOCK_M, per expert
    tl.store(expert_end_ptr + experts, ends, mask=present)
    for start in range(0, max_tiles, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        expert = tl.sum((tile_ends[None, :] <= t[:, None]).to(tl.int32), axis=1)  # EXPERTS past the last tile
        mine = experts[None, :] == expert[:, None]
        first = tl.sum(tl.where(mine, row_minus_tile[None, :], 0), axis=1) + t * BLOCK_M
        tl.store(expert_ptr + t, expert, mask=t < max_tiles)
        tl.store(first_row_ptr + t, first, mask=t < max_tiles)


_EXPERT_TILES = FastKernel(_expert_tiles_kernel)


def expert_tiles(counts: Tensor, num_rows: int, block_m: int | None = None) -> ExpertTiles:
    """The tile map of `num_rows` rows grouped by expert, counts [E] rows per expert, built on the device by one
    kernel (no host read: CUDA graphs and no sync) for the most tiles any split of the rows needs. The tile height
    follows the mean rows per expert (`block_m` overrides it: bench)."""
    num_experts = counts.shape[0]
    per_expert = num_rows / num_experts
    block_m = block_m or (16 if per_expert <= 32 else 64 if per_expert <= 128 else 128)
    max_tiles = triton.cdiv(num_rows, block_m) + num_experts
    stride = triton.cdiv(max_tiles, 4) * 4  # one allocation for the three, each part 16-byte aligned
    parts = torch.empty(2 * stride + num_experts, dtype=torch.int32, device=counts.device)
    expert, first_row, expert_end = parts[:max_tiles], parts[stride:stride + max_tiles], parts[2 * stride:]
    _EXPERT_TILES.launch((1,), (counts, expert, first_row, expert_end), (num_experts, max_tiles), 4, 3,
                         BLOCK_M=block_m, EXPERTS=triton.next_power_of_2(num_experts), BLOCK_T=64)
    return ExpertTiles(expert, first_row, expert_end, block_m)


def grouped_matmul(x: Tensor, weights: Tensor, tiles: ExpertTiles,
                   config: tuple[int, int, int, int] | None = None) -> Tensor:
    """x [R, K] (rows of expert 0, then expert 1, ...), weights [E, N, K], `tiles` the map of those rows
    (`expert_tiles`) -> [R, N], row r through its expert's weight."""
    return _grouped(x, weights, None, tiles, config)[0]


def grouped_matmul_pair(x: Tensor, first: Tensor, second: Tensor, tiles: ExpertTiles,
                        config: tuple[int, int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """`grouped_matmul` of x through two weight sets of one shape [E, N, K] (an expert FFN's gate and up) in one
    launch -> two [R, N], each bit for bit what `grouped_matmul` gives it alone."""
    return _grouped(x, first.contiguous(), second.contiguous(), tiles, config)


def _grouped(x: Tensor, weights: Tensor, second: Tensor | None, tiles: ExpertTiles,
             config: tuple[int, int, int, int] | None) -> tuple[Tensor, Tensor | None]:
    x = rows_contiguous(x)
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    num_rows, depth = x.shape
    num_experts, num_cols, _ = weights.shape
    y = x.new_empty(num_rows, num_cols)
    y2 = None if second is None else x.new_empty(num_rows, num_cols)
    if not num_rows or not num_cols:
        return y, y2
    max_tiles = tiles.expert.shape[0]
    pairs = 1 if second is None else 2
    block_m, block_n, warps, stages = config or _gemm_config(0, pairs * num_cols, (tiles.block_m,), max_tiles)
    grid = (max_tiles, pairs * triton.cdiv(num_cols, block_n))
    _MATMUL.launch(grid, (x, weights, weights if second is None else second, weights, y, y if y2 is None else y2,
                          tiles.expert, tiles.first_row, tiles.expert_end),
                   (num_rows, num_cols, depth, num_experts, x.stride(0), weights.stride(0), weights.stride(1),
                    y.stride(0)), warps, stages,
                   GROUPED=True, PAIRED=second is not None, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n,
                   BLOCK_K=BLOCK_K)
    return y, y2


@triton.jit(do_not_specialize=["stride_lse_h"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, q_start_ptr, q_len_ptr, q_pos_ptr, k_start_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                      stride_lse_h, scale_log2, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, STORE_LSE: tl.constexpr):
    """Program (sequence, tile, KV head): tile row r is query r // GROUP of the sequence in query head
    kv_head * GROUP + r % GROUP (the heads sharing the KV head read its keys once); query i sits at position
    q_pos + i and attends to keys 0..q_pos + i of the sequence's key store (rows k_start.. of k and v).
    `STORE_LSE`: also the natural log-sum-exp of each row's scaled scores, at lse[head, q_start + i] (flash
    attention's backward takes it, so training need not rerun a forward for it)."""
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
    if STORE_LSE:
        lse = (running_max + tl.log2(total)) * 0.6931471805599453
        tl.store(lse_ptr + heads.to(tl.int64) * stride_lse_h + q_start + queries, lse, mask=row_ok)
    o_rows = (q_start + queries)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(o_ptr + o_rows, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


_ATTENTION = FastKernel(_attention_kernel)


def attention(q: Tensor, keys: Tensor, values: Tensor, q_start: Tensor, q_len: Tensor, q_pos: Tensor,
              k_start: Tensor, max_q_len: int, scale: float, lse: Tensor | None = None,
              block_m: int | None = None) -> Tensor:
    """Causal attention of packed queries q [T, nq, D] against key/value stores [R, nkv, D] (row stride free).

    Sequence b's queries are rows q_start[b].. (q_len[b] of them) at positions q_pos[b].., and its keys and
    values at positions 0.. are rows k_start[b].. of the stores (int32 [N] each, on the device). `max_q_len`
    bounds q_len (the grid). Training and fresh prefill: the stores are the packed k and v themselves; the engine's
    cache: a slot's rows. `lse` [nq, T] fp32: filled with each query row's log-sum-exp (training). `block_m`
    overrides the tile height (tests, bench)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    num_seqs = q_len.shape[0]
    if not num_seqs or not q.shape[0]:
        return out
    group = num_heads // keys.shape[1]
    block_m = block_m or ATTN_BLOCK_M
    grid = (num_seqs, triton.cdiv(max_q_len * group, block_m), keys.shape[1])
    _ATTENTION.launch(grid, (q, keys, values, out, lse if lse is not None else out, q_start, q_len, q_pos, k_start),
                      (q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
                       out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
                       scale * 1.4426950408889634), ATTN_WARPS if block_m <= 64 else 2 * ATTN_WARPS,
                      GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=ATTN_BLOCK_N, STORE_LSE=lse is not None)
    return out
