"""HF `config.json` -> typed `ModelConfig`, the only place model hyper-parameters are read.

Keys absent from config.json take the defaults of transformers' config class of the family (5.x), listed in
`_DEFAULTS`; both the current `rope_parameters` and the older `rope_theta` / `rope_scaling` keys are read. Reading
needs no transformers import, so workers start fast. The family decides the HF names and the optional pieces
(biases, q/k norm, shared expert). `model.override_config` (verl's key) changes config.json fields before any of
this is read, see `apply_overrides`.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shardrl.errors import UserError

Family = Literal["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
FAMILY_PREFIX: dict[Family, str] = {
    "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe",
    "qwen3_moe": "Qwen3Moe",
}
# The causal LM and the heads a critic or reward model is saved with share the decoder; see `Transformer`.
_ARCH_SUFFIXES = ("ForCausalLM", "ForTokenClassification", "ForSequenceClassification")
ARCHITECTURES: dict[str, Family] = {p + s: fam for fam, p in FAMILY_PREFIX.items() for s in _ARCH_SUFFIXES}

RopeKind = Literal["default", "linear", "llama3"]


class ModelConfigError(UserError, ValueError):
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
    def from_pretrained(cls, path: str | Path, overrides: Mapping[str, Any] = {}) -> ModelConfig:
        """Read `<path>/config.json` (or a config.json file path), with `overrides` of its fields applied first
        (`apply_overrides`), so the model built from it, and the config.json exported with it, follow them."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise ModelConfigError(f"{file}: no config.json found")
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ModelConfigError(f"{file}: not valid JSON ({err})") from None
        try:
            return cls.from_dict(apply_overrides(raw, overrides))
        except OverrideError:
            raise
        except ModelConfigError as err:
            raise ModelConfigError(f"{file}: {str(err).removeprefix('config.json ')}") from None
        except (KeyError, TypeError) as err:  # a field the family needs is absent or of the wrong type
            raise ModelConfigError(f"{file}: missing or malformed field ({type(err).__name__}: {err})") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = (raw.get("architectures") or [None])[0]
        family = ARCHITECTURES.get(architecture)
        if family is None:
            raise ModelConfigError(f"config.json architectures={raw.get('architectures')!r} is not supported; "
                                   f"supported: {', '.join(sorted(ARCHITECTURES))}")
        given = {_ALIASES.get(k, k): v for k, v in raw.items() if v is not None}
        cfg = _Keys({**_DEFAULTS["all"], **_DEFAULTS[family], **given})
        _check_supported(family, cfg)
        attention_bias = bool(cfg["attention_bias"])
        qkv_bias = {"qwen2": True, "qwen2_moe": bool(cfg.get("qkv_bias"))}.get(family, attention_bias)
        num_heads = cfg["num_attention_heads"]
        return cls(
            family=family, architecture=architecture, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg["rms_norm_eps"]), rope=_rope(cfg),
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]), qkv_bias=qkv_bias,
            o_bias=attention_bias if family in ("llama", "qwen3", "qwen3_moe") else False,
            mlp_bias=bool(cfg["mlp_bias"]), qk_norm=family in ("qwen3", "qwen3_moe"),
            initializer_range=float(cfg["initializer_range"]), moe=_moe(family, cfg), hf_config=dict(raw),
        )


class OverrideError(ModelConfigError):
    """A `model.override_config` entry names a field the model family's config does not have; `field` is its name
    (for the caller to report under its own config key)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def apply_overrides(raw: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """config.json fields `raw` with `overrides` (verl's `model.override_config`) applied; `raw` is not modified.

    verl sets each entry on the transformers config object before building the model; here each entry replaces the
    config.json field of that name (a mapping value replaces the whole field, e.g. all of `rope_scaling`), so the
    same fields and values mean the same model. An entry must name a field of the family's transformers config
    (`_FIELDS`) or one config.json has: a typo would otherwise change nothing, silently. The legacy `rope_theta` and
    `rope_scaling` update `rope_parameters` when config.json keeps RoPE there (transformers 5 does, and ignores
    them then), so an override of either always reaches the model.
    """
    if not overrides:
        return raw
    family = ARCHITECTURES.get((raw.get("architectures") or [None])[0])
    known = set(raw) | (_COMMON_FIELDS | _FIELDS[family] if family is not None else set())
    unknown = sorted(set(overrides) - known)
    if unknown:
        what = f"the {FAMILY_PREFIX[family]} config" if family is not None else "this config.json"
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "fix the name or drop the entry"
        raise OverrideError(unknown[0], f"model.override_config.{unknown[0]}: not a field of {what}; {hint}")
    out = {**raw, **overrides}
    rope = raw.get("rope_parameters")
    if rope and "rope_parameters" not in overrides and {"rope_theta", "rope_scaling"} & set(overrides):
        # rope_scaling replaces the scaling (null: none); theta is rope_theta's if given, else as it was.
        scaling = (overrides["rope_scaling"] or {"rope_type": "default"}) if "rope_scaling" in overrides else rope
        theta = overrides.get("rope_theta", scaling.get("rope_theta", rope.get("rope_theta")))
        out["rope_parameters"] = {**scaling, **({"rope_theta": theta} if theta is not None else {})}
    return out


# Fields of transformers' (5.x) config classes of each family that `apply_overrides` accepts besides those
# config.json has: the `PretrainedConfig` fields and the decoder fields all families share, then each family's own.
# Legacy names shardrl still reads count too: rope_theta, rope_scaling, torch_dtype, head_dim (read by every
# family's attention when present), and the expert count under the other of num_experts / num_local_experts.
_COMMON_FIELDS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "id2label", "is_encoder_decoder",
    "label2id", "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "use_cache", "tie_word_embeddings", "rope_parameters", "attention_dropout", "bos_token_id",
    "eos_token_id", "pad_token_id",
    "rope_theta", "rope_scaling", "torch_dtype", "head_dim",  # legacy
})
_QWEN_WINDOW = frozenset({"sliding_window", "use_sliding_window", "layer_types", "max_window_layers"})
_ROUTER = frozenset({"num_experts_per_tok", "output_router_logits", "router_aux_loss_coef"})
_QWEN_MOE = _ROUTER | {"decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob"}
_FIELDS: dict[Family, frozenset[str]] = {
    "llama": frozenset({"attention_bias", "mlp_bias", "pretraining_tp"}),
    "qwen2": _QWEN_WINDOW,
    "qwen3": _QWEN_WINDOW | {"attention_bias"},
    "mixtral": _ROUTER | {"num_local_experts", "num_experts", "router_jitter_noise", "sliding_window"},
    "qwen2_moe": _QWEN_WINDOW | _QWEN_MOE | {"num_experts", "qkv_bias", "shared_expert_intermediate_size"},
    "qwen3_moe": _QWEN_MOE | {"num_local_experts", "num_experts", "attention_bias", "sliding_window",
                              "use_sliding_window"},
}


# transformers' defaults for keys a config.json may leave out (sizes have no defaults here: they must be given).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "all": dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", initializer_range=0.02,
                rope_theta=10000.0, attention_bias=False, mlp_bias=False),
    "llama": {},
    "qwen2": dict(use_sliding_window=False),
    "qwen3": dict(use_sliding_window=False),
    "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, num_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(qkv_bias=True, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[], use_sliding_window=False),
    "qwen3_moe": dict(num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                      use_sliding_window=False),
}

# transformers 5 writes Mixtral's and Qwen3-MoE's expert count as num_local_experts; hub configs often num_experts.
_ALIASES = {"num_local_experts": "num_experts"}


class _Keys(dict):
    def __missing__(self, key: str) -> Any:
        raise ModelConfigError(f"config.json has no {key!r}, which this model needs")


def _check_supported(family: Family, cfg: _Keys) -> None:
    if cfg["hidden_act"] != "silu":
        raise ModelConfigError(f"config.json hidden_act={cfg['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    layer_types = cfg.get("layer_types")
    if layer_types:
        sliding = any(t != "full_attention" for t in layer_types)
    elif "use_sliding_window" in cfg:  # Qwen families: the window applies only when switched on
        sliding = bool(cfg["use_sliding_window"])
    else:
        sliding = cfg.get("sliding_window") is not None
    if sliding:
        raise ModelConfigError(f"config.json sliding_window={cfg.get('sliding_window')!r} (layer_types="
                               f"{layer_types!r}, use_sliding_window={cfg.get('use_sliding_window')!r}): "
                               f"sliding-window attention is not supported")


def _rope(cfg: _Keys) -> RopeConfig:
    params = cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg["rope_theta"]}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg["rope_theta"]))
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


def _moe(family: Family, cfg: _Keys) -> MoEConfig | None:
    num_layers = cfg["num_hidden_layers"]
    if family == "mixtral":
        return MoEConfig(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                         ffn_size=cfg["intermediate_size"], norm_topk_prob=True, shared_expert_size=0,
                         layers=frozenset(range(num_layers)), block_name="block_sparse_moe",
                         expert_proj=("w1", "w3", "w2"))
    if family not in ("qwen2_moe", "qwen3_moe"):
        return None
    num_experts, step, dense = cfg["num_experts"], cfg["decoder_sparse_step"], cfg["mlp_only_layers"]
    layers = frozenset(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return MoEConfig(num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
                     ffn_size=cfg["moe_intermediate_size"], norm_topk_prob=bool(cfg["norm_topk_prob"]),
                     shared_expert_size=cfg["shared_expert_intermediate_size"] if family == "qwen2_moe" else 0,
                     layers=layers, block_name="mlp", expert_proj=("gate_proj", "up_proj", "down_proj"))
