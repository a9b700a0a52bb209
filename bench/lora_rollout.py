"""Folded against runtime adapters in the rollout engine, one GPU, same process: what each costs.

A LoRA rollout engine either applies the adapters in its forward (runtime LoRA, `EngineConfig.lora_runtime`: two
small GEMMs per adapted linear and step, CUDA graphs included) or folds them into its weights after each sync (the
default, `ModelRunner.fold_adapters`: W = W_base + s B A from a pristine host copy of each adapted base weight, as
a bf16 fold cannot be undone exactly).

Measured, on the same random weights, prompts and sampling: generated tokens/s of an engine without adapters, of
the folding engine and of the runtime one; the time of one fold of every adapter (what the folding engine pays per
sync, host-to-device copies of the pristine weights included) and the host memory of those copies. Models:
Llama-3.2-1B's sizes (bench/train_mfu.py's dense shape) and its MoE shape with adapters on the experts too
(`--models`).

    python bench/lora_rollout.py            # on the GPU
    python bench/lora_rollout.py --quick    # tiny shapes on CPU (a smoke test of the script)
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from rollout_throughput import run_engine
from train_mfu import QUICK_SHAPES, SHAPES, random_init, sync
from shardrl.models.config import ModelConfig
from shardrl.parallel.layout import Layout
from shardrl.parallel.lora import EXPERT_PARAMETERS, LoRASettings
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--merges", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="EngineConfig.compile_decode (default: eager graphs)")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.prompt_len, args.new_tokens, args.rank, args.merges = 4, 8, 8, 4, 1
    return args


def build_engine(shape: dict, lora: LoRASettings | None, runtime: bool, args: argparse.Namespace,
                 device: torch.device) -> Engine:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_len = args.prompt_len + args.new_tokens
    config = EngineConfig(max_num_seqs=args.num_prompts, max_num_batched_tokens=16384, max_model_len=max_len,
                          cpu_kv_cache_tokens=args.num_prompts * max_len, dtype=dtype, lora=lora,
                          lora_runtime=runtime, seed=0,
                          compile_decode=device.type == "cuda" and args.compile)
    cfg = ModelConfig.from_dict(shape)
    engine = Engine(cfg, Layout.single(device), config)
    random_init([engine.model], cfg.initializer_range)  # the adapters' B too: nonzero, as after training
    engine.set_policy_version(rewritten=engine.model.parameters())  # as a first sync: folds them (by default)
    return engine


def fold_seconds(engine: Engine, repeats: int, device: torch.device) -> tuple[float, int]:
    """Seconds of one fold of every adapter (a later sync's, from the pristine copies), and those copies' bytes."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        engine.runner.fold_adapters(())
        sync(device)
        times.append(time.perf_counter() - start)
    copies = engine.runner.adapted_weights
    return min(times), sum(p.numel() * p.element_size() for p in copies)


def measure(name: str, args: argparse.Namespace, device: torch.device) -> None:
    shape = (QUICK_SHAPES if args.quick else SHAPES)[name]
    experts = EXPERT_PARAMETERS if name == "moe" else ()
    lora = LoRASettings(args.rank, 2.0 * args.rank, target_parameters=experts)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape["vocab_size"], (args.num_prompts, args.prompt_len), generator=generator).tolist()
    params = [SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=i)
              for i in range(args.num_prompts)]
    rates = {}
    variants = (("no adapters", None, False), (f"folded LoRA r{args.rank}", lora, False),
                (f"runtime LoRA r{args.rank}", lora, True))
    for label, settings, runtime in variants:
        engine = build_engine(shape, settings, runtime, args, device)
        print(f"{name}, {label}:", flush=True)
        rates[label] = run_engine(engine, prompts, params, device)
        if settings is not None and not runtime:
            seconds, copy_bytes = fold_seconds(engine, args.merges, device)
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    plain, folded, runtime = rates.values()
    print(f"{name}: tokens/s folded / none {folded / plain:.3f}x, runtime / folded {runtime / folded:.3f}x; a fold of "
          f"every adapter {seconds * 1e3:.1f} ms per sync, pristine host copies {copy_bytes / 2**20:,.0f} MiB",
          flush=True)


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.quick else "cuda")
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens, rank {args.rank}")
    for name in args.models.split(","):
        measure(name, args, device)


if __name__ == "__main__":
    main()
