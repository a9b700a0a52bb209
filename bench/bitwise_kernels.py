"""Bitwise mode's kernels one by one (`shardrl/parallel/bitwise_kernels.py`) against the default ones at the model
shapes of `bench/bitwise_cost.py`, with every candidate tile configuration, and whether the configurations give
equal bits (GPU only).

* GEMM: each (rows, N, K) of the dense 0.5B and the MoE shape, decode-sized (1..256 rows) and training-sized (8,192),
  `matmul` / `grouped_matmul` per tile configuration against cuBLAS (`F.linear`, `F.grouped_mm`), timed from one
  CUDA graph of repeated calls (as the engine's decode runs; no launch overhead). Prints the best configuration, its
  time over cuBLAS's, and `equal` when every configuration's output equals the first's bit for bit.
* Attention: prefill / training (16 sequences of 512) and decode (128 single queries at 64..1024 keys) per tile
  height against flash attention, and whether each height's output equals the 16-row tile's; the log-sum-exp the
  kernel stores against flash's.

    python bench/bitwise_kernels.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cuda_timing import cuda_ms
from shardrl.parallel import bitwise_kernels as bk

# The configurations the kernels choose from, and alternatives that lost (kept to show it).
CANDIDATES = [*bk.GEMM_CONFIGS, (128, 256, 8, 3), (128, 128, 4, 4), (128, 64, 4, 4), (32, 32, 4, 4)]
DENSE_GEMMS = [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864),
               ("lm_head", 151936, 896)]
MOE_GEMMS = [("router", 32, 512), ("qkv", 1024, 512), ("o", 512, 512), ("lm_head", 32000, 512)]
MOE_EXPERTS = [("experts gate_up", 32, 512, 512), ("experts down", 32, 512, 256)]
ROWS = [1, 16, 64, 128, 256, 8192]


def graph_ms(fn, calls: int = 20) -> float:
    """Milliseconds per call of `fn`, replayed from one CUDA graph of `calls` calls (mean of 5 replays): small
    kernels without launch overhead, as the engine's decode runs them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (5 * calls)


def report(label: str, baseline_ms: float, chosen_ms: float, results: dict, outputs: dict) -> None:
    """One line: the default kernel's time, the chosen configuration's and the best one's over it, bit equality."""
    first = next(iter(outputs.values()))
    equal = all(torch.equal(out, first) for out in outputs.values())
    best = min(results, key=results.get)
    fastest = sorted(results, key=results.get)[:4]
    ranked = " ".join(f"{c[0]}x{c[1]}w{c[2]}:{results[c] / baseline_ms:.2f}" for c in fastest)
    print(f"{label:34s} default {baseline_ms * 1e3:8.1f} us  chosen {chosen_ms / baseline_ms:5.2f}x  best {best} "
          f"{results[best] / baseline_ms:5.2f}x  {'equal' if equal else 'DIFFER'}  [{ranked}]", flush=True)


def bench_gemms() -> None:
    g = torch.Generator("cuda").manual_seed(0)
    for model, gemms in (("dense", DENSE_GEMMS), ("moe", MOE_GEMMS)):
        for name, cols, depth in gemms:
            w = torch.randn(cols, depth, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
            for rows in ROWS:
                x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16, generator=g)
                results, outputs = {}, {}
                timer = graph_ms if rows <= 256 else cuda_ms  # large outputs: launch overhead is negligible
                for config in CANDIDATES:
                    outputs[config] = bk.matmul(x, w, config=config)
                    results[config] = timer(lambda: bk.matmul(x, w, config=config))
                report(f"{model} {name} M={rows}", timer(lambda: F.linear(x, w)), timer(lambda: bk.matmul(x, w)),
                       results, outputs)
    for name, experts, cols, depth in MOE_EXPERTS:
        w = torch.randn(experts, cols, depth, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
        for tokens in ROWS:
            rows = tokens * 4  # top 4
            counts = torch.bincount(torch.randint(0, experts, (rows,), device="cuda", generator=g),
                                    minlength=experts)
            offsets = counts.cumsum(0).int()
            x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16, generator=g)
            results, outputs = {}, {}
            timer = graph_ms if rows <= 1024 else cuda_ms
            for config in CANDIDATES:
                tiles = bk.expert_tiles(counts, rows, block_m=config[0])
                outputs[config] = bk.grouped_matmul(x, w, tiles, config=config)
                results[config] = timer(lambda: bk.grouped_matmul(x, w, tiles, config=config))
            chosen = timer(lambda: bk.grouped_matmul(x, w, bk.expert_tiles(counts, rows)))
            report(f"moe {name} M={rows}", timer(lambda: F.grouped_mm(x, w.transpose(1, 2), offs=offsets)),
                   chosen, results, outputs)
            print(f"  tile map alone {timer(lambda: bk.expert_tiles(counts, rows)) * 1e3:.1f} us", flush=True)


def bench_attention() -> None:
    g = torch.Generator("cuda").manual_seed(1)
    for model, heads, kv_heads in (("dense", 14, 2), ("moe", 8, 4)):
        lengths = [512] * 16
        cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).int()
        total = int(cu[-1])
        q, k, v = (torch.randn(total, h, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (heads, kv_heads, kv_heads))
        starts, lens = cu[:-1], cu[1:] - cu[:-1]
        zeros = torch.zeros_like(starts)
        flash_out, flash_lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, 512, 512, 0.0, True, False, scale=0.125)
        base = cuda_ms(lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, 512, 512, 0.0, True, False, scale=0.125))
        results, outputs = {}, {}
        for block_m in (16, 32, 64, 128):
            outputs[(block_m, 64, 0)] = bk.attention(q, k, v, starts, lens, zeros, starts, 512, 0.125,
                                                     block_m=block_m)
            results[(block_m, 64, 0)] = cuda_ms(lambda: bk.attention(q, k, v, starts, lens, zeros, starts, 512,
                                                                      0.125, block_m=block_m))
        report(f"{model} attention prefill 16x512", base, results[(bk.ATTN_BLOCK_M, 64, 0)], results, outputs)
        lse = torch.empty(heads, total, device="cuda", dtype=torch.float32)
        bk.attention(q, k, v, starts, lens, zeros, starts, 512, 0.125, lse=lse)
        print(f"  flash lse shape {tuple(flash_lse.shape)}; ours vs flash max |d| "
              f"{(lse - flash_lse.reshape(lse.shape)).abs().max().item():.2e}; out max |d| "
              f"{(outputs[(16, 64, 0)].float() - flash_out.float()).abs().max().item():.2e}", flush=True)
        # Decode: 128 sequences, one query each at its last position, reading its keys from the packed store.
        seqs = 128
        ctx = torch.randint(64, 1025, (seqs,), device="cuda", generator=g).int()
        kv_start = torch.cat([torch.zeros(1, device="cuda", dtype=torch.int32), ctx.cumsum(0).int()[:-1]])
        keys = torch.randn(int(ctx.sum()), kv_heads, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        values = torch.randn_like(keys)
        query = torch.randn(seqs, heads, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        rows = torch.arange(seqs, device="cuda", dtype=torch.int32)
        ones = torch.ones_like(rows)
        results, outputs = {}, {}
        for block_m in (16, 32, 64):
            outputs[(block_m, 64, 0)] = bk.attention(query, keys, values, rows, ones, ctx - 1, kv_start, 1, 0.125,
                                                     block_m=block_m)
            results[(block_m, 64, 0)] = graph_ms(lambda: bk.attention(query, keys, values, rows, ones, ctx - 1,
                                                                      kv_start, 1, 0.125, block_m=block_m))
        k_cu = torch.cat([torch.zeros(1, device="cuda", dtype=torch.int32), ctx.cumsum(0).int()])
        q_cu = torch.arange(seqs + 1, device="cuda", dtype=torch.int32)
        def flash_decode():
            return torch.ops.aten._flash_attention_forward(query, keys, values, q_cu, k_cu, 1, 1024, 0.0, True,
                                                           False, scale=0.125)
        try:
            base = graph_ms(flash_decode)
        except RuntimeError as error:  # not capturable in this torch: timed with its launches
            print(f"  flash decode not graph-capturable ({str(error).splitlines()[0]}); events instead")
            base = cuda_ms(flash_decode)
        report(f"{model} attention decode 128 seqs", base, results[(bk.ATTN_BLOCK_M, 64, 0)], results, outputs)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    bench_attention()
    bench_gemms()


if __name__ == "__main__":
    main()
