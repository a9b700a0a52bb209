"""The weight-sync checksum's block sums as one Triton kernel (`verify.checksum` on CUDA): one program per block of
words, each read once, times its position's multiplier and summed in uint64 (wrapping modulo 2**64, as the torch
path's int64 arithmetic does), so a checksum costs one pass over the bucket."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _block_sums_kernel(words_ptr, mult_ptr, out_ptr, num_words, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    positions = tl.arange(0, BLOCK)
    index = block * BLOCK + positions
    words = tl.load(words_ptr + index, mask=index < num_words, other=0).to(tl.uint64, bitcast=True)
    mult = tl.load(mult_ptr + positions).to(tl.uint64, bitcast=True)
    total = tl.sum(words * mult, axis=0)
    tl.store(out_ptr + block, total.to(tl.int64, bitcast=True))


def block_sums(words: Tensor, mult: Tensor, num_blocks: int, block_words: int) -> Tensor:
    """words int64 [n] (contiguous), mult int64 [block_words] -> int64 [num_blocks]: per block of `block_words`
    words (the last one ragged), the sum of words times multipliers modulo 2**64."""
    out = torch.empty(num_blocks, dtype=torch.int64, device=words.device)
    _block_sums_kernel[(num_blocks,)](words, mult, out, words.numel(), BLOCK=block_words)
    return out
