"""Decode attention: the engine's split-KV kernel against flash attention's variable-length kernel (the decode
attention before it), per layer call, same random cache, same process (GPU only).

Each shape is one decode step's attention of one layer: `rows` sequences, one new query token each, attending to a
random number of cached tokens (mean `mean`, spread +-50%) in a [rows, length, kv_heads, head_dim] bf16 cache.
Prints microseconds per call replayed from a CUDA graph, as the engine's decode runs it (eager calls of a small
shape time the host's launch cost, not the kernel), the cache bytes read per second and the ratio, and each
kernel's max |diff| against the fp32 reference.

    python bench/decode_attention.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from shardrl.rollout.decode_attention import num_splits_for, split_kv_decode_attention
from shardrl.rollout.kv_cache import reference_decode_attention

# (name, query heads, KV heads, head_dim, rows, cache length, mean tokens used)
SHAPES = [
    ("async-300m", 16, 8, 64, 384, 1024, 600),  # bench/async_speedup.py's model, a rollout GPU's steady state
    ("async-300m", 16, 8, 64, 128, 1024, 600),
    ("async-300m", 16, 8, 64, 16, 1024, 600),
    ("qwen2-0.5b", 14, 2, 64, 256, 512, 384),  # bench/rollout_throughput.py's default
    ("qwen2-0.5b", 14, 2, 64, 32, 2048, 1500),
    ("qwen3-8b/tp2", 16, 4, 128, 128, 4096, 2000),
]


def flash_varlen(q: Tensor, keys: Tensor, values: Tensor, used: Tensor, max_length: int, scale: float) -> Tensor:
    """The baseline: the cache as one packed run of rows * length tokens, row b's keys from b * length, `used` of
    them (`seqused_k`), one query token per row."""
    starts = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return torch.ops.aten._flash_attention_forward(
        q, keys.flatten(0, 1), values.flatten(0, 1), starts, starts * keys.shape[1], 1, max_length, 0.0, False,
        False, scale=scale, seqused_k=used)[0]


def microseconds(fn: Callable[[], Tensor], iters: int = 20) -> float:
    """GPU time of one call: `iters` calls captured in one CUDA graph (after an eager call that compiles the
    kernels), the graph replayed a few times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()  # warm
    torch.cuda.synchronize()
    replays = 5
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (replays * iters) * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_attention.py needs a CUDA GPU")
    for name, num_heads, num_kv, dim, rows, length, mean in SHAPES:
        torch.manual_seed(0)
        keys = torch.randn(rows, length, num_kv, dim, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        q = torch.randn(rows, num_heads, dim, device="cuda", dtype=torch.bfloat16)
        used = torch.randint(mean // 2, min(length, mean * 3 // 2), (rows,), device="cuda", dtype=torch.int32)
        scale = dim ** -0.5
        mask = torch.arange(length, device="cuda") < used.unsqueeze(1)  # [rows, length]
        reference = reference_decode_attention(q.float(), keys.float().transpose(1, 2),
                                               values.float().transpose(1, 2), mask, scale)
        kernels = {"flash": lambda: flash_varlen(q, keys, values, used, length, scale),
                   "split-kv": lambda: split_kv_decode_attention(q, keys, values, used, length, scale)}
        times = {k: microseconds(fn) for k, fn in kernels.items()}
        errors = {k: float((fn().float() - reference).abs().max()) for k, fn in kernels.items()}
        read = int(used.sum()) * num_kv * dim * 2 * keys.element_size()  # keys and values of the used tokens
        splits = num_splits_for(rows, num_kv, length, q.device)
        cells = ", ".join(f"{k} {t:.1f} us ({read / t / 1e3:,.0f} GB/s, max|diff| {errors[k]:.2g})"
                          for k, t in times.items())
        print(f"{name} rows={rows} mean_used={int(used.float().mean())} splits={splits}: {cells}; "
              f"split-kv {times['flash'] / times['split-kv']:.2f}x flash")


if __name__ == "__main__":
    main()
