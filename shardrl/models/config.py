"""HF `config.json` -> typed `ModelConfig`, the only place model hyper-parameters are read.

HF's own config classes fill in each family's defaults (and translate old `rope_theta`/`rope_scaling` keys into
`rope_parameters`), so a checkpoint means the same thing here as in transformers. The family decides what HF names
and optional pieces (biases, q/k norm, shared expert) the model has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from transformers import AutoConfig

Family = Literal["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
FAMILY_PREFIX: dict[Family, str] = {
    "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe",
    "qwen3_moe": "Qwen3Moe",
}
# The causal LM and the heads a critic or reward model is saved with share the decoder; see `Transformer`.
_ARCH_SUFFIXES = ("ForCausalLM", "ForTokenClassification", "ForSequenceClassification")
ARCHITECTURES: dict[str, Family] = {p + s: fam for fam, p in FAMILY_PREFIX.items() for s in _ARCH_SUFFIXES}

RopeKind = Literal["default", "linear", "llama3"]


class ModelConfigError(ValueError):
    """config.json describes a model shardrl cannot build; the message names the key and value."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: RopeKind = "default"
    factor: float = 1.0  # linear and llama3 scaling
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    ffn_size: int  # of one routed expert
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    shared_expert_size: int  # 0: no shared expert (Qwen2-MoE has one, with a sigmoid gate)
    layers: frozenset[int]  # decoder layers whose FFN is an MoE block (the others are dense)
    block_name: str  # HF module of the block: "mlp" or Mixtral's "block_sparse_moe"
    expert_proj: tuple[str, str, str]  # HF names of an expert's gate, up, down projections


@dataclass(frozen=True)
class ModelConfig:
    family: Family
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense FFN size
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    initializer_range: float
    moe: MoEConfig | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # config.json, for export

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json` (or a config.json file path)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise ModelConfigError(f"{file}: no config.json found")
        return cls.from_dict(json.loads(file.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = (raw.get("architectures") or [None])[0]
        family = ARCHITECTURES.get(architecture)
        if family is None:
            raise ModelConfigError(f"config.json architectures={raw.get('architectures')!r} is not supported; "
                                   f"supported: {', '.join(sorted(ARCHITECTURES))}")
        hf = AutoConfig.for_model(family, **{k: v for k, v in raw.items() if k != "model_type"})
        _check_supported(hf)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        qkv_bias = {"qwen2": True, "qwen2_moe": bool(getattr(hf, "qkv_bias", True))}.get(family, attention_bias)
        return cls(
            family=family, architecture=architecture, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            rms_norm_eps=hf.rms_norm_eps, rope=_rope(hf.rope_parameters),
            tie_word_embeddings=bool(hf.tie_word_embeddings), qkv_bias=qkv_bias,
            o_bias=attention_bias if family in ("llama", "qwen3", "qwen3_moe") else False,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)), qk_norm=family in ("qwen3", "qwen3_moe"),
            initializer_range=hf.initializer_range, moe=_moe(family, hf), hf_config=dict(raw),
        )


def _check_supported(hf: Any) -> None:
    if hf.hidden_act != "silu":
        raise ModelConfigError(f"config.json hidden_act={hf.hidden_act!r}: only 'silu' (SwiGLU) is supported")
    layer_types = getattr(hf, "layer_types", None)
    sliding = (any(t != "full_attention" for t in layer_types) if layer_types
               else getattr(hf, "sliding_window", None) is not None)
    if sliding:
        raise ModelConfigError(f"config.json sliding_window={getattr(hf, 'sliding_window', None)!r} with "
                               f"layer_types={layer_types!r}: sliding-window attention is not supported")


def _rope(params: dict[str, Any]) -> RopeConfig:
    kind = params.get("rope_type", "default")
    theta = float(params["rope_theta"])
    if kind == "default":
        return RopeConfig(theta)
    if kind == "linear":
        return RopeConfig(theta, "linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(theta, "llama3", factor=float(params["factor"]),
                          low_freq_factor=float(params["low_freq_factor"]),
                          high_freq_factor=float(params["high_freq_factor"]),
                          original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    raise ModelConfigError(f"config.json rope_parameters.rope_type={kind!r}: supported are default, linear, llama3")


def _moe(family: Family, hf: Any) -> MoEConfig | None:
    if family == "mixtral":
        return MoEConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                         ffn_size=hf.intermediate_size, norm_topk_prob=True, shared_expert_size=0,
                         layers=frozenset(range(hf.num_hidden_layers)), block_name="block_sparse_moe",
                         expert_proj=("w1", "w3", "w2"))
    if family not in ("qwen2_moe", "qwen3_moe"):
        return None
    layers = frozenset(i for i in range(hf.num_hidden_layers)
                       if i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0)
    return MoEConfig(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok, ffn_size=hf.moe_intermediate_size,
                     norm_topk_prob=bool(hf.norm_topk_prob),
                     shared_expert_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0, layers=layers,
                     block_name="mlp", expert_proj=("gate_proj", "up_proj", "down_proj"))
