"""The weight-sync checksum as one Triton kernel (`verify.checksum` on CUDA): one program per block of words, each
read once, times its position's multiplier and summed in uint64 (wrapping modulo 2**64, as the torch path's int64
arithmetic does), plus the block's salt computed in place, so a checksum is one launch and one pass over the
bucket."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _u64(value):
    return value.to(tl.int64).to(tl.uint64, bitcast=True)


@triton.jit(do_not_specialize=["seed"])
def _checksum_kernel(words_ptr, mult_ptr, out_ptr, num_words, seed, golden, mix1, mix2, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    positions = tl.arange(0, BLOCK)
    index = block * BLOCK + positions
    words = tl.load(words_ptr + index, mask=index < num_words, other=0).to(tl.uint64, bitcast=True)
    mult = tl.load(mult_ptr + positions).to(tl.uint64, bitcast=True)
    total = tl.sum(words * mult, axis=0)
    # The salt: SplitMix64's finaliser of block * golden + seed (verify.salts). Scalars that fit 32 bits arrive as
    # int32: widen them before reading their bits as uint64.
    x = block.to(tl.uint64, bitcast=True) * _u64(golden) + _u64(seed)
    x = x ^ (x >> 30)
    x = x * _u64(mix1)
    x = x ^ (x >> 27)
    x = x * _u64(mix2)
    x = x ^ (x >> 31)
    tl.store(out_ptr + block, (total + x).to(tl.int64, bitcast=True))


def salted_block_sums(words: Tensor, mult: Tensor, num_blocks: int, block_words: int, seed: int, golden: int,
                      mix: tuple[int, int]) -> Tensor:
    """words int64 [n] (contiguous), mult int64 [block_words] -> int64 [num_blocks]: per block of `block_words`
    words (the last one ragged), the sum of words times multipliers plus splitmix(block * golden + seed), modulo
    2**64 (`seed`, `golden`, `mix`: int64 values)."""
    out = torch.empty(num_blocks, dtype=torch.int64, device=words.device)
    _checksum_kernel[(num_blocks,)](words, mult, out, words.numel(), seed, golden, *mix, BLOCK=block_words)
    return out
