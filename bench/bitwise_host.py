"""Where the host time of a bitwise-mode trainer step goes (GPU only): the small MoE of `bench/bitwise_cost.py`
(hidden 512, 32 experts top 4) is host-bound, its step being little but kernel launches.

* Launch costs: host microseconds per call (enqueue only, 200 calls, no sync between) of the bitwise kernels
  through Triton's own launch and through `FastKernel` (`parallel/triton_launch.py`), against the default ops.
* The step: forward and backward enqueue times (host clock when each call returns) and the wall time with a sync,
  default mode vs bitwise mode (and bitwise with Triton's own launches), median of `--repeats`.
* `--profile`: the torch profiler's CPU table of one step per mode (autograd nodes, ops, launches) under $OUT or
  `--out`.

    python bench/bitwise_host.py [--model moe|dense] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bitwise_cost import DENSE, MOE
from shardrl.models.config import ModelConfig
from shardrl.models.fast_paths import FastPaths
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.models.transformer import Transformer
from shardrl.parallel.data import GradBuffers
from shardrl.parallel.layout import Layout
from shardrl.parallel.triton_launch import FastKernel

FAST_LAUNCH = FastKernel.launch


def triton_launch(self, grid, tensors, scalars, num_warps, num_stages=3, **constexprs):
    self.launch_through_triton(grid, tensors, scalars, num_warps, num_stages, constexprs)


def use_triton_launch(on: bool) -> None:
    FastKernel.launch = triton_launch if on else FAST_LAUNCH


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per call of `fn` (enqueue only), median of 5 batches of `calls`."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def launch_costs(tokens: int, hidden: int) -> None:
    from shardrl.models import norm_kernel
    from shardrl.parallel import bitwise_kernels as bk

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    norm_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    experts = torch.randn(32, 256, hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    counts = torch.full((32,), tokens // 32, device="cuda", dtype=torch.long)
    tiles = bk.expert_tiles(counts, tokens)
    rows = {
        "torch.empty": lambda: torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16),
        "autograd.Function apply (identity)": lambda: _Identity.apply(x),
        "F.linear": lambda: F.linear(x, w),
        "F.rms_norm * w": lambda: norm_w * F.rms_norm(x, (hidden,), eps=1e-6),
    }
    for name, fn in rows.items():
        print(f"  {name:42s} {host_us(fn):7.1f} us", flush=True)
    kernels = {
        "matmul": lambda: bk.matmul(x, w),
        "grouped_matmul": lambda: bk.grouped_matmul(x, experts, tiles),
        "grouped_matmul_pair (gate and up)": lambda: bk.grouped_matmul_pair(x, experts, experts, tiles),
        "expert_tiles": lambda: bk.expert_tiles(counts, tokens),
        "rms_norm": lambda: norm_kernel.rms_norm(x, norm_w, 1e-6),
        "rms_norm_backward": lambda: norm_kernel.rms_norm_backward(x, x, norm_w, 1e-6),
    }
    for name, fn in kernels.items():
        use_triton_launch(True)
        slow = host_us(fn)
        use_triton_launch(False)
        fast = host_us(fn)
        print(f"  {name:42s} {slow:7.1f} us through Triton, {fast:7.1f} us FastKernel", flush=True)


def build(path: Path, bitwise: bool, tokens: int):
    config = ModelConfig.from_pretrained(path)
    model = Transformer(config, Layout.single("cuda"), dtype=torch.bfloat16, fast=FastPaths(bitwise=bitwise))
    load_hf_weights(model, path)
    grads = GradBuffers(model.parameters(), Layout.single("cuda"))
    ids = torch.randint(1, config.vocab_size, (tokens,), device="cuda")
    positions = torch.arange(tokens, device="cuda") % 512
    cu_seqlens = torch.arange(0, tokens + 1, 512, device="cuda", dtype=torch.int32)

    def step() -> tuple[float, float, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        grads.zero()
        hidden = model(ids, positions, cu_seqlens)
        logprobs, _ = model.compute_logprobs(hidden, ids.roll(-1))
        forward = time.perf_counter()
        logprobs.mean().backward()
        backward = time.perf_counter()
        torch.cuda.synchronize()
        return forward - start, backward - forward, time.perf_counter() - start

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["moe", "dense"], default="moe")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    family, shape = {"moe": ("qwen3_moe", MOE), "dense": ("qwen2", DENSE)}[args.model]
    print(f"launch costs (host us per call, {args.tokens} x {shape['hidden_size']}):", flush=True)
    launch_costs(args.tokens, shape["hidden_size"])
    modes = {"default": (False, False), "bitwise": (True, False), "bitwise, Triton's launch": (True, True)}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(family, Path(tmp) / family, noise_std=0.05, **shape)
        results, profiled = {}, set()
        for _ in range(2):  # two rounds, alternating; best median each
            for name, (bitwise, slow_launch) in modes.items():
                use_triton_launch(slow_launch)
                step = build(path, bitwise, args.tokens)
                for _ in range(3):
                    step()
                times = [step() for _ in range(args.repeats)]
                medians = tuple(statistics.median(t[i] for t in times) * 1e3 for i in range(3))
                if name not in results or medians[2] < results[name][2]:
                    results[name] = medians
                if args.profile and name not in profiled:
                    profiled.add(name)
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
                        step()
                    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=60)
                    label = name.replace(" ", "_").replace(",", "").replace("'", "")
                    Path(args.out, f"profile_{args.model}_{label}.txt").write_text(table)
                    print(f"--- {name}: top self CPU\n"
                          + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
                use_triton_launch(False)
        print(f"{args.model}, {args.tokens} tokens: forward enqueue / backward enqueue / step wall, ms (median)")
        for name in modes:
            fwd, bwd, wall = results[name]
            print(f"  {name:28s} {fwd:6.1f} {bwd:6.1f} {wall:6.1f}  ({wall / results['default'][2]:.3f}x)")


if __name__ == "__main__":
    main()
