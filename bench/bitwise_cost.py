"""What bitwise mode costs on one GPU: rollout tokens/s and trainer step time, default kernels vs the batch-invariant
ones (`FastPaths.bitwise`, `EngineConfig.bitwise`), each measured in this process after a warm-up.

Shapes (random bf16 weights): a Qwen2-0.5B-like dense model, a small Qwen3-MoE-like one (32 experts, top 4, hidden
512: host-bound, its step is launch time) and `moe-mid`: a Mixtral-architecture block of
Qwen3-30B-A3B's widths (hidden 2048, 64 experts of 768, top 8; 8 layers, 2.4B parameters). Rollout:
`--prompts` prompts of 64..`--prompt` tokens, `--response` new tokens each (CUDA-graph decode). Trainer step: one
micro batch of `--train-tokens` packed tokens (sequences of 512), forward + log-probs + backward into the trainer's
fp32 gradient buffers (`GradBuffers`; the optimizer is the same in both modes and left out, so the ratio is an upper
bound on a whole step's). The two modes alternate for `--rounds` rounds and each reports its best round (one H200's
throughput drifted by up to 1.4x between calls).

    python bench/bitwise_cost.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from shardrl.models.config import ModelConfig
from shardrl.models.fast_paths import FastPaths
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.models.transformer import Transformer
from shardrl.parallel.data import GradBuffers
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams

DENSE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096)
MOE = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
           head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
           max_position_embeddings=4096)
MOE_MID = dict(architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=2048, num_hidden_layers=8,
               num_attention_heads=32, num_key_value_heads=4, intermediate_size=768, num_local_experts=64,
               num_experts_per_tok=8, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--train-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also print the top CUDA kernels of each timed part")
    parser.add_argument("--models", nargs="+", choices=["dense", "moe", "moe-mid"], default=["dense", "moe"])
    parser.add_argument("--parts", nargs="+", choices=["rollout", "train"], default=["rollout", "train"])
    return parser.parse_args()


def profiled(fn, label: str, enabled: bool):
    """Run fn(); with `enabled` under the torch profiler, printing its ten costliest CUDA kernels."""
    if not enabled:
        return fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
    print(f"--- {label}\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=16), flush=True)
    return result


def randomize(model: torch.nn.Module) -> None:
    """Random weights for a shape too large to write as a checkpoint first: N(0, 0.02), norms 1."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.02)
            else:
                param.fill_(1.0)


def rollout_tokens_per_second(source: Path | dict, bitwise: bool, args: argparse.Namespace) -> float:
    """`source`: a checkpoint directory, or an HF config dict whose model gets random weights here."""
    config = EngineConfig(max_num_seqs=args.prompts, max_num_batched_tokens=16384,
                          max_model_len=args.prompt + args.response, dtype=torch.bfloat16,
                          gpu_memory_utilization=0.6, bitwise=bitwise)
    if isinstance(source, Path):
        engine = Engine.from_pretrained(source, Layout.single("cuda"), config)
    else:
        engine = Engine(ModelConfig.from_dict(source), Layout.single("cuda"), config)
        randomize(engine.model)
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(1, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(64, args.prompt + 1, (args.prompts,), generator=g)]
    params = SamplingParams(max_tokens=args.response, temperature=1.0, ignore_eos=True)
    engine.generate(prompts[:16], [params] * 16)  # warm-up: kernels compile, graphs capture
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, [params] * len(prompts))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del engine
    torch.cuda.empty_cache()
    return sum(len(o.token_ids) for o in outputs) / seconds


def train_step_seconds(source: Path | dict, bitwise: bool, tokens: int) -> float:
    """`source`: a checkpoint directory, or an HF config dict whose model gets random weights here."""
    config = ModelConfig.from_pretrained(source) if isinstance(source, Path) else ModelConfig.from_dict(source)
    model = Transformer(config, Layout.single("cuda"), dtype=torch.bfloat16, fast=FastPaths(bitwise=bitwise))
    if isinstance(source, Path):
        load_hf_weights(model, source)
    else:
        randomize(model)
    grads = GradBuffers(model.parameters(), Layout.single("cuda"))  # as the trainer: fp32 main_grad accumulation
    ids = torch.randint(1, config.vocab_size, (tokens,), device="cuda")
    positions = torch.arange(tokens, device="cuda") % 512
    cu_seqlens = torch.arange(0, tokens + 1, 512, device="cuda", dtype=torch.int32)

    def step() -> None:
        grads.zero()
        hidden = model(ids, positions, cu_seqlens)
        logprobs, _ = model.compute_logprobs(hidden, ids.roll(-1))
        logprobs.mean().backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start, repeats = time.perf_counter(), 5
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    args = parse_args()
    models = {"dense": ("dense 0.5B", "qwen2", DENSE), "moe": ("MoE 32x top4", "qwen3_moe", MOE),
              "moe-mid": ("MoE 64x768 top8, hidden 2048", None, MOE_MID)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, family, shape in (models[m] for m in args.models):
            path = shape if family is None else make_tiny_checkpoint(family, Path(tmp) / family, noise_std=0.05,
                                                                     **shape)
            tps, step = {False: [], True: []}, {False: [], True: []}
            for _ in range(args.rounds):
                for mode in (False, True):
                    if "rollout" in args.parts:
                        tps[mode].append(profiled(lambda: rollout_tokens_per_second(path, mode, args),
                                                  f"{name} rollout bitwise={mode}", args.profile))
                    if "train" in args.parts:
                        step[mode].append(profiled(lambda: train_step_seconds(path, mode, args.train_tokens),
                                                   f"{name} train bitwise={mode}", args.profile))
            if tps[False]:
                fast, slow = max(tps[False]), max(tps[True])
                print(f"{name}: rollout {fast:.0f} -> {slow:.0f} tok/s (bitwise {fast / slow:.3f}x slower)", flush=True)
            if step[False]:
                fast, slow = min(step[False]), min(step[True])
                print(f"{name}: train fwd+bwd {fast * 1e3:.1f} -> {slow * 1e3:.1f} ms ({slow / fast:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
