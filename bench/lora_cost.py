"""What LoRA saves on one GPU: the actor's step time and peak memory at rank 32 against full fine-tuning, and the
weight sync's seconds and bytes (the first sync moves every tensor, later ones the adapters alone), same process.

Model: Llama-3.2-1B's sizes (bench/train_mfu.py's dense shape), random bf16 weights. A step is `update_policy` over
`--seqs` sequences of `--seq-len` tokens in micro batches of `--micro` (PPO loss, backward, clipped AdamW), as the
actor runs it. The sync goes to a rollout-side model of the same shape with the same adapters (`WeightSync`, the
colocated path without the engine's KV cache). Full fine-tuning is the baseline.

    python bench/lora_cost.py            # on the GPU
    python bench/lora_cost.py --quick    # tiny shapes on CPU (a smoke test of the script)
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from train_mfu import QUICK_SHAPES, SHAPES, random_init, sync, synthetic_batch
from shardrl.algos import ClipRange
from shardrl.job.options import EngineOptions, OptimOptions, PolicyLossOptions, UpdateOptions
from shardrl.models.config import ModelConfig
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.lora import LoRASettings, attach_lora
from shardrl.sync.shards import Shards
from shardrl.sync.weight_sync import WeightSync
from shardrl.workers.actor import update_policy
from shardrl.workers.engine import ModelEngine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    return parser.parse_args()


def measure(shape: dict, lora: LoRASettings | None, args: argparse.Namespace, device: torch.device) -> dict:
    registry = GroupRegistry()
    layout = Layout.create(LayoutSpec(world_size=1), device=device, registry=registry)
    cfg = ModelConfig.from_dict(shape)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = ModelEngine(cfg, layout, EngineOptions(dtype=dtype, optim=OptimOptions(lr=1e-5), lora=lora),
                         weights_loader=lambda chunks: random_init(chunks, cfg.initializer_range))
    batch = synthetic_batch(args.seqs, args.seq_len, cfg.vocab_size, seed=0)
    loss = PolicyLossOptions(loss_agg_mode="token-mean", clip=ClipRange(0.2),
                             max_response_length=args.seq_len - args.seq_len // 4)
    update = UpdateOptions(mini_batch_size=args.seqs, micro_batch_size=args.micro)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        update_policy(engine, batch, loss, update)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    trainable = sum(p.numel() for chunk in engine.chunks for p in chunk.parameters() if p.requires_grad)
    rollout_model = Transformer(cfg, layout, dtype=dtype).requires_grad_(False)
    if lora is not None:
        attach_lora(rollout_model, lora, layout)
    weights = WeightSync(None, device, 256 << 20, "checksum",
                         Shards(engine.chunks, sending=True, host=engine.host_buffers), Shards(rollout_model))
    syncs = [weights.sync() for _ in range(3)]
    result = dict(step=min(times), peak_gib=peak, trainable=trainable,
                  syncs=[(s["sync/seconds"], s["sync/bytes"]) for s in syncs])
    del engine, rollout_model, weights
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.quick else "cuda")
    shape = QUICK_SHAPES["dense"] if args.quick else SHAPES["dense"]
    if args.quick:
        args.seqs, args.seq_len, args.micro, args.rank = 4, 64, 2, 4
    runs = {"full": measure(shape, None, args, device),
            f"lora r{args.rank}": measure(shape, LoRASettings(args.rank, 2.0 * args.rank), args, device)}
    for name, r in runs.items():
        first, later = r["syncs"][0], r["syncs"][-1]
        print(f"{name}: step {r['step'] * 1e3:.1f} ms, peak {r['peak_gib']:.2f} GiB, trainable {r['trainable']:,}; "
              f"sync first {first[0] * 1e3:.1f} ms / {first[1] / 2**20:.1f} MiB, later {later[0] * 1e3:.2f} ms / "
              f"{later[1] / 2**20:.2f} MiB", flush=True)
    full, lora = runs.values()
    print(f"LoRA / full: step {lora['step'] / full['step']:.3f}x, "
          f"peak memory {lora['peak_gib'] / full['peak_gib']:.3f}x, "
          f"later sync {lora['syncs'][-1][0] / full['syncs'][-1][0]:.4f}x time, "
          f"{lora['syncs'][-1][1] / full['syncs'][-1][1]:.5f}x bytes", flush=True)


if __name__ == "__main__":
    main()
