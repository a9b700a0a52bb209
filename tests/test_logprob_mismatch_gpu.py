"""Rollout-engine vs trainer logprob mismatch in bf16 on one GPU: the number off-policy corrections (TIS, decoupled
PPO) exist for. The native engine samples (bf16, CUDA-graph decode, paged KV cache) from a random Qwen2-shaped model
with a real-sized vocabulary; the trainer path (`ModelEngine` + `compute_log_prob`: packing, varlen attention,
vocab-parallel logprobs, bf16) recomputes the logprob of every sampled token. Printed for the record: mean and max
|d| (d = rollout - trainer logprob per response token) and the k1 / k3 estimates of KL(rollout || trainer)
(k1 = mean d, k3 = mean(exp(-d) - 1 + d); the tokens are samples of the rollout policy).

Thresholds. Both sides run the same bf16 weights on the same tokens and differ only in kernels (KV-cache decode
attention vs packed prefill attention, GEMMs over 1 vs T rows), i.e. in bf16 rounding (8 significand bits): hidden
states drift by a few bf16 ulps, which the LM head turns into logit differences of ~|z| * 2^-8 (|z| up to ~20 here).
The same comparison run on CPU in bf16 (its SDPA/GEMM kernels; no CUDA graphs), 7776 tokens, gave mean |d| 0.045,
max |d| 0.26, k1 0.0013, k3 0.0019 (bf16 rollout vs fp32 trainer: 0.056, 0.33, 0.0022, 0.0027; fp32 vs fp32:
mean |d| 4e-6, so the two paths agree up to rounding). The bounds leave 2-4x headroom over that: mean |d| < 0.1,
max |d| < 1, |k1| < 0.01, k3 < 0.01. A temperature mix-up (trainer at 0.9, rollout at 1; fp32 on CPU) gives mean |d|
0.20, k1 0.029, k3 0.030: each beyond its bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardrl.data.batch import Batch
from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams
from shardrl.workers.actor import compute_log_prob, log_prob_pass
from shardrl.job.options import EngineOptions, ForwardBatching
from shardrl.workers.engine import ROUTED_EXPERTS, ROUTING_MISMATCH, ModelEngine
from shardrl.workers.rollout import generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_PROMPTS, MAX_PROMPT, RESPONSE, VOCAB = 48, 200, 256, 32000
MODEL = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
# Small perturbations keep the random layers smooth (larger ones make them chaotic: any rounding difference grows
# layer by layer, unlike in a trained model); a 5x sharper LM head gives the peaked next-token distributions of a
# trained LM (entropy ~3.6 nats, logits up to ~20) instead of near-uniform ones over the 32k tokens.
NOISE_STD, LM_HEAD_SCALE = 0.05, 5.0
BOUNDS = dict(mean_abs=0.1, max_abs=1.0, k1_abs=0.01, k3=0.01)


def make_checkpoint(out_dir: Path, family: str = "qwen2", shape: dict = MODEL) -> Path:
    path = make_tiny_checkpoint(family, out_dir, noise_std=NOISE_STD, **shape)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] *= LM_HEAD_SCALE
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def prompt_batch(seed: int = 0) -> Batch:
    """Left-padded random prompts of 8..MAX_PROMPT tokens (the trainer's prompt layout)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, MAX_PROMPT + 1, (NUM_PROMPTS,), generator=g)
    cols = torch.arange(MAX_PROMPT)
    attention = (cols >= MAX_PROMPT - lengths[:, None]).long()  # [B, P]
    ids = torch.randint(1, VOCAB, (NUM_PROMPTS, MAX_PROMPT), generator=g) * attention
    return Batch({"input_ids": ids, "attention_mask": attention,
                  "position_ids": (attention.cumsum(-1) - 1).clamp_min(0)})


def rollout_samples(path: Path, device: str, dtype: torch.dtype, record_routing: bool = False) -> tuple[Batch, bool]:
    """Sample with the rollout engine (CUDA-graph decode on CUDA) -> (samples, whether graphs ran)."""
    engine = Engine.from_pretrained(path, Layout.single(device), EngineConfig(
        max_num_seqs=NUM_PROMPTS, max_num_batched_tokens=4096, max_model_len=MAX_PROMPT + RESPONSE, dtype=dtype,
        gpu_memory_utilization=0.9, cpu_kv_cache_tokens=NUM_PROMPTS * (MAX_PROMPT + RESPONSE),
        record_routing=record_routing))
    # Mixed lengths: the decode batch shrinks as requests finish, crossing CUDA-graph row buckets.
    params = [SamplingParams(max_tokens=RESPONSE - 4 * i, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(NUM_PROMPTS)]
    samples = generate(engine, prompt_batch(), params, RESPONSE, pad_token_id=0)
    return samples, engine.runner.graphs is not None


def rollout_vs_trainer(path: Path, device: str, dtype: torch.dtype) -> dict[str, float]:
    """Sample with the rollout engine, recompute with the trainer path; mismatch statistics over the response
    tokens."""
    samples, graphs_used = rollout_samples(path, device, dtype)
    trainer = ModelEngine(ModelConfig.from_pretrained(path), Layout.single(device), EngineOptions(dtype=dtype),
                          hf_path=str(path))
    log_probs, entropy = compute_log_prob(trainer, samples, ForwardBatching(micro_batch_size=8, max_token_len=None))  # [B, R] each
    mask = samples.tensors["response_mask"].bool()
    d = (samples.tensors["rollout_log_probs"] - log_probs)[mask]  # [N] rollout - trainer
    return dict(tokens=float(d.numel()), mean_abs=d.abs().mean().item(), max_abs=d.abs().max().item(),
                k1=d.mean().item(), k3=(torch.exp(-d) - 1 + d).mean().item(),
                mean_logprob=log_probs[mask].mean().item(), mean_entropy=entropy[mask].mean().item(),
                graphs=float(graphs_used))


def test_bf16_rollout_vs_trainer_logprob_mismatch(tmp_path):
    stats = rollout_vs_trainer(make_checkpoint(tmp_path / "qwen2"), "cuda", torch.bfloat16)
    print("\nlogprob mismatch, bf16 rollout (CUDA graphs) vs bf16 trainer: "
          + ", ".join(f"{k} {v:.4g}" for k, v in stats.items()))
    assert stats["graphs"] == 1.0, "the decode did not run under CUDA graphs"
    assert stats["tokens"] == sum(RESPONSE - 4 * i for i in range(NUM_PROMPTS))
    assert stats["mean_abs"] < BOUNDS["mean_abs"] and stats["max_abs"] < BOUNDS["max_abs"], stats
    assert abs(stats["k1"]) < BOUNDS["k1_abs"] and stats["k3"] < BOUNDS["k3"], stats


MOE = dict(MODEL, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=192, head_dim=64, norm_topk_prob=True)


def test_bf16_moe_mismatch_with_r3_routing_replay_is_below_the_routers_own(tmp_path):
    """A Qwen3-MoE shape in bf16: the trainer routing itself picks other experts than the rollout for some (token,
    layer) pairs (bf16 rounding flips near-ties), and those tokens' log-probs move by far more than rounding. R3
    (the pass replaying the rollout's recorded routing, CUDA-graph decode included) removes that part: its mean
    |d| and k3 are below the own-routing pass's on the same samples."""
    path = make_checkpoint(tmp_path / "moe", "qwen3_moe", MOE)
    samples, graphs_used = rollout_samples(path, "cuda", torch.bfloat16, record_routing=True)
    assert graphs_used and ROUTED_EXPERTS in samples.tensors.keys()
    trainer = ModelEngine(ModelConfig.from_pretrained(path), Layout.single("cuda"),
                          EngineOptions(dtype=torch.bfloat16), hf_path=str(path))
    batching = ForwardBatching(micro_batch_size=8, max_token_len=None)
    mask = samples.tensors["response_mask"].bool()
    results = {}
    for name, routing in (("own", "compare"), ("R3", "replay")):
        out = log_prob_pass(trainer, samples, batching, 1.0, routing)
        d = (samples.tensors["rollout_log_probs"] - out["log_probs"])[mask]
        differs, compared = out[ROUTING_MISMATCH].sum(0).tolist()
        results[name] = dict(mean_abs=d.abs().mean().item(), max_abs=d.abs().max().item(),
                             k3=(torch.exp(-d) - 1 + d).mean().item(), routing_differs=differs / compared)
    print("\nMoE bf16 rollout vs trainer: " + "; ".join(
        f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in r.items()) for name, r in results.items()))
    assert int(mask.sum()) >= 7000
    assert results["own"]["routing_differs"] > 0  # near-ties flip in bf16: what R3 is for
    assert results["R3"]["mean_abs"] < results["own"]["mean_abs"] and results["R3"]["k3"] < results["own"]["k3"]
