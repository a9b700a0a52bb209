"""MoE routing mismatch in bf16 on one GPU: how far the trainer's log-probs are from the rollout's, and how often the
two route a token differently, with routing replay off, R2 and R3, in one run.

A random Qwen3-MoE shape (32 experts, top 4; small weight noise and a sharpened LM head, as in
tests/test_logprob_mismatch_gpu.py, so the next-token distributions look like a trained LM's and the routers have
near-ties, as real ones do) in bf16. The native engine samples 48 prompts (CUDA-graph decode) recording its routing;
the trainer path (`ModelEngine`, packed varlen prefill, bf16) recomputes the sampled tokens' log-probs:

- rollout vs old-logprob pass: the pass routing itself (off, and R2: R2 does not change this pass) against the pass
  replaying the rollout's routing (R3);
- old-logprob pass vs update pass: the update cuts the batch into other micro batches (dynamic, by tokens), so bf16
  GEMMs round differently; routing itself (off) against replaying the old-logprob pass's routing (R2).

Per comparison: mean and max |d| (d = one log-prob minus the other per response token), k3 = mean(exp(-d) - 1 + d),
and the fraction of (token, MoE layer) pairs whose expert sets differ. The cost of recording routing in the engine
is measured in the same process: generated tokens per second with `record_routing` off and on (a warm-up run
first), printed as a ratio.

    python bench/routing_mismatch.py            # the GPU benchmark
    python bench/routing_mismatch.py --quick    # tiny shape on CPU, fp32: a smoke test
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shardrl.data.batch import Batch
from shardrl.job.options import EngineOptions, ForwardBatching
from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams
from shardrl.workers.actor import log_prob_pass
from shardrl.workers.engine import ROUTED_EXPERTS, ROUTING_MISMATCH, ModelEngine
from shardrl.workers.samples import generate

MOE = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
           head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
           max_position_embeddings=2048)
TINY = dict(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=256)
NOISE_STD, LM_HEAD_SCALE = 0.05, 5.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape, fp32 on CPU (smoke test)")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--response", type=int, default=256)
    return parser.parse_args()


def make_checkpoint(out_dir: Path, shape: dict) -> Path:
    path = make_tiny_checkpoint("qwen3_moe", out_dir, noise_std=NOISE_STD, norm_topk_prob=True, **shape)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] *= LM_HEAD_SCALE
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def prompt_batch(num: int, max_prompt: int, vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, max_prompt + 1, (num,), generator=g)
    attention = (torch.arange(max_prompt) >= max_prompt - lengths[:, None]).long()
    ids = torch.randint(1, vocab, (num, max_prompt), generator=g) * attention
    return Batch({"input_ids": ids, "attention_mask": attention,
                  "position_ids": (attention.cumsum(-1) - 1).clamp_min(0)})


def sample(path: Path, layout: Layout, dtype: torch.dtype, prompts: Batch, response: int,
           record: bool) -> tuple[Batch, float]:
    """One rollout of `prompts` -> (samples, generated tokens per second of the timed run after a warm-up)."""
    num = len(prompts)
    engine = Engine.from_pretrained(path, layout, EngineConfig(
        max_num_seqs=num, max_num_batched_tokens=8192, max_model_len=prompts.tensors["input_ids"].shape[1] + response,
        dtype=dtype, gpu_memory_utilization=0.5, record_routing=record))
    # Mixed lengths: the decode batch shrinks as requests finish, crossing CUDA-graph row buckets.
    params = [SamplingParams(max_tokens=response - (4 * i) % (response // 2), temperature=1.0, seed=i,
                             ignore_eos=True) for i in range(num)]
    generate(engine, prompts, params, response, pad_token_id=0)  # warm-up: graph captures
    sync(layout.device)
    start = time.perf_counter()
    samples = generate(engine, prompts, params, response, pad_token_id=0)
    sync(layout.device)
    seconds = time.perf_counter() - start
    return samples, float(samples.tensors["response_mask"].sum()) / seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stats(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, routing: torch.Tensor | None) -> dict[str, float]:
    d = (a - b)[mask]
    out = dict(mean_abs=d.abs().mean().item(), max_abs=d.abs().max().item(), k3=(torch.exp(-d) - 1 + d).mean().item())
    if routing is not None:
        differs, compared = routing.sum(0).tolist()
        out["routing_differs"] = differs / max(compared, 1.0)
    return out


def main() -> None:
    args = parse_args()
    quick = args.quick or not torch.cuda.is_available()
    device = torch.device("cpu" if quick else "cuda")
    dtype = torch.float32 if quick else torch.bfloat16
    shape = TINY if quick else MOE
    num, response = (6, 12) if quick else (args.prompts, args.response)
    layout = Layout.single(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "moe", shape)
        prompts = prompt_batch(num, 16 if quick else 200, shape["vocab_size"])
        _, plain_rate = sample(path, layout, dtype, prompts, response, record=False)
        samples, recording_rate = sample(path, layout, dtype, prompts, response, record=True)
        trainer = ModelEngine(ModelConfig.from_pretrained(path), layout, EngineOptions(dtype=dtype), hf_path=str(path))
    mask = samples.tensors["response_mask"].bool()
    rollout = samples.tensors["rollout_log_probs"]
    old_batching = ForwardBatching(micro_batch_size=8, max_token_len=None)
    update_batching = ForwardBatching(micro_batch_size=None, max_token_len=4096 if not quick else 64)
    own = log_prob_pass(trainer, samples, old_batching, 1.0, "record")  # routes itself, counted against the rollout
    r3 = log_prob_pass(trainer, samples, old_batching, 1.0, "replay")
    record = samples.take(list(range(len(samples))))
    record.tensors[ROUTED_EXPERTS] = own[ROUTED_EXPERTS]
    update_off = log_prob_pass(trainer, record, update_batching, 1.0, "compare")
    update_r2 = log_prob_pass(trainer, record, update_batching, 1.0, "replay")
    rows = {
        "rollout vs old-logprob, off/R2": stats(rollout, own["log_probs"], mask, own[ROUTING_MISMATCH]),
        "rollout vs old-logprob, R3": stats(rollout, r3["log_probs"], mask, r3[ROUTING_MISMATCH]),
        "old-logprob vs update, off": stats(own["log_probs"], update_off["log_probs"], mask,
                                            update_off[ROUTING_MISMATCH]),
        "old-logprob vs update, R2": stats(own["log_probs"], update_r2["log_probs"], mask,
                                           update_r2[ROUTING_MISMATCH]),
    }
    print(f"{'quick (CPU fp32)' if quick else torch.cuda.get_device_name(device) + ', bf16'}: {int(mask.sum())} "
          f"sampled tokens, {num} prompts, {shape['num_experts']} experts top {shape['num_experts_per_tok']}, "
          f"{shape['num_hidden_layers']} layers")
    print("routing_differs: own top-k vs the other pass's (under replay: the choices it overrode)")
    print(f"{'comparison':34} {'mean|d|':>9} {'max|d|':>9} {'k3':>10} {'routing differs':>16}")
    for name, row in rows.items():
        print(f"{name:34} {row['mean_abs']:9.4g} {row['max_abs']:9.4g} {row['k3']:10.3g} "
              f"{row['routing_differs']:16.4f}")
    print(f"rollout tokens/s: record_routing off {plain_rate:,.0f}, on {recording_rate:,.0f}, "
          f"ratio on/off {recording_rate / plain_rate:.3f}")


if __name__ == "__main__":
    main()
