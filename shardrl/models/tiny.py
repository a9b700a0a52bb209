"""Tiny random HF checkpoints of every supported family, made and saved by HF transformers itself.

For tests (parity against transformers) and the default CPU job. Every parameter, norms and biases included, is
perturbed away from HF's init so a mis-mapped tensor cannot hide behind a constant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardrl.models.config import FAMILY_PREFIX, Family

_COMMON: dict[str, Any] = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, dtype="float32",
)
# Each family exercises its own features: Llama-3 rope scaling and tied embeddings, Qwen3's head_dim != H/heads
# and q/k norms, Qwen2-MoE's shared expert and a dense layer among MoE layers.
TINY_CONFIGS: dict[Family, dict[str, Any]] = {
    "llama": dict(tie_word_embeddings=True, attention_bias=True, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(head_dim=16, tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
}


def make_tiny_checkpoint(family: Family, out_dir: str | Path, seed: int = 0, noise_std: float = 0.1,
                         max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a random `family` model with tiny dimensions to `out_dir`; `overrides` change HF config keys.

    `max_shard_size` (e.g. "20KB") makes transformers write a sharded checkpoint with an index file.
    """
    from transformers import AutoConfig, AutoModelForCausalLM  # only the checkpoint makers need transformers

    config = AutoConfig.for_model(family, **{**_COMMON, **TINY_CONFIGS[family], **overrides},
                                  architectures=[f"{FAMILY_PREFIX[family]}ForCausalLM"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * noise_std)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return out_dir


def packed_batch(lengths: list[int], vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random packed sequences: input_ids [T], position_ids [T] (restarting per sequence), cu_seqlens [N+1] int32."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (sum(lengths),), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return input_ids, position_ids, cu_seqlens


@torch.no_grad()
def hf_logits(path: str | Path, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Reference logits [T, V] from transformers, each packed sequence run on its own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bounds = cu_seqlens.tolist()
    return torch.cat([model(input_ids[a:b].unsqueeze(0)).logits[0] for a, b in zip(bounds, bounds[1:])])
