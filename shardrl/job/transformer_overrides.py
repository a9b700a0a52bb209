"""Megatron's `override_transformer_config`: the TransformerConfig fields verl users pass through it, read here.

verl's Megatron scripts set fields of Megatron's TransformerConfig through this mapping (the full-recompute trio
`recompute_granularity=full recompute_method=uniform recompute_num_layers=1`, the MoE loss coefficients,
`moe_router_dtype=fp32`, kernel fusion switches, `attention_backend`). Each field is either read (its effect is
compiled into the role's model options), accepted only with the value that names what shardrl always does (the
fused kernels of its CUDA path), or refused with a one-line error naming it: a mapping key is never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardrl.job.errors import ConfigError
from shardrl.models.fast_paths import AttentionKernel
from shardrl.parallel.expert import RouterOptions

# Fields whose value has an effect.
READ = ("recompute_granularity", "recompute_method", "recompute_num_layers", "moe_aux_loss_coeff", "moe_z_loss_coeff",
        "moe_router_dtype", "attention_backend")
# Kernel-fusion switches: shardrl's CUDA path always runs the fused version, so only `true` describes it.
ALWAYS_FUSED = {
    "apply_rope_fusion": "rotary embedding is one fused kernel",
    "bias_activation_fusion": "SwiGLU is one fused kernel",
    "gradient_accumulation_fusion": "weight gradients accumulate straight into the fp32 main gradient",
    "moe_permute_fusion": "the MoE dispatch and combine are fused gathers",
    "moe_grouped_gemm": "the experts run as grouped GEMMs",
}
# The training attention kernel on CUDA (`FastPaths.attention`): Megatron's AttnBackend names its choice among
# kernels; shardrl's are torch's flash attention, FlashAttention-4 (`fa4`, the optional flash-attn-4 package), and
# `auto` (Megatron's default too): FA4 where it is installed and runs on the GPU, else flash.
ATTENTION_BACKENDS: tuple[AttentionKernel, ...] = ("flash", "fa4", "auto")


@dataclass(frozen=True)
class TransformerOverrides:
    """What a role's `override_transformer_config` changes: per-layer activation recompute, how MoE routers train
    (the load-balancing and z loss coefficients, 0 turning a loss off; fp32 router logits), and which kernel runs
    attention on CUDA."""

    recompute: bool
    router: RouterOptions
    attention: AttentionKernel


def read_transformer_overrides(overrides: dict[str, Any], key: str) -> TransformerOverrides:
    """Check every field of `overrides` (the mapping at `key`) and compile the ones shardrl reads; raises ConfigError
    naming `key.override_transformer_config.<field>` for a field or value shardrl cannot honour."""
    prefix = f"{key}.override_transformer_config"
    for field, value in overrides.items():
        where = f"{prefix}.{field}"
        if field in ALWAYS_FUSED:
            if value is not True:
                raise ConfigError(where, f"{value!r} is not supported: in shardrl {ALWAYS_FUSED[field]} on CUDA "
                                         f"(there is no unfused path to choose); set true or remove the key")
        elif field == "attention_backend":
            if value not in ATTENTION_BACKENDS:
                raise ConfigError(where, f"{value!r} is not supported: shardrl's attention kernels are torch's flash "
                                         f"attention and FlashAttention-4; set flash, fa4 or auto, or remove the key")
        elif field not in READ:
            accepted = ", ".join([*READ, *ALWAYS_FUSED])
            raise ConfigError(where, f"not a setting shardrl's model reads (it reads {accepted}); remove the key")
    router_dtype = overrides.get("moe_router_dtype")
    if router_dtype not in (None, "fp32"):
        raise ConfigError(f"{prefix}.moe_router_dtype", f"{router_dtype!r} is not supported: shardrl computes router "
                                                        f"logits in the model dtype, or in fp32 when this is fp32; set "
                                                        f"fp32 or remove the key")
    router = RouterOptions(aux_loss_coef=_coefficient(overrides, "moe_aux_loss_coeff", prefix),
                           z_loss_coef=_coefficient(overrides, "moe_z_loss_coeff", prefix),
                           fp32_logits=router_dtype == "fp32")
    return TransformerOverrides(recompute=_recompute(overrides, prefix), router=router,
                                attention=overrides.get("attention_backend", "auto"))


def _recompute(overrides: dict[str, Any], prefix: str) -> bool:
    """Whether Megatron's recompute fields ask for recompute; shardrl recomputes each layer on its own (Megatron's
    full / uniform / 1), so other shapes of recompute are refused rather than approximated."""
    granularity = overrides.get("recompute_granularity")
    method = overrides.get("recompute_method")
    num_layers = overrides.get("recompute_num_layers")
    if granularity not in (None, "full"):
        raise ConfigError(f"{prefix}.recompute_granularity", f"{granularity!r} is not supported: shardrl recomputes "
                                                             f"whole layers; set full (or remove the key)")
    if method not in (None, "uniform"):
        raise ConfigError(f"{prefix}.recompute_method", f"{method!r} is not supported: shardrl recomputes every "
                                                        f"layer; set uniform (or remove the key)")
    if num_layers not in (None, 1):
        raise ConfigError(f"{prefix}.recompute_num_layers", f"{num_layers!r} is not supported: shardrl recomputes "
                                                            f"each layer on its own; set 1 (or remove the key)")
    if granularity is None and (method is not None or num_layers is not None):
        field = "recompute_method" if method is not None else "recompute_num_layers"
        raise ConfigError(f"{prefix}.{field}", "has no effect without recompute_granularity=full; set that too, or "
                                               "remove the key")
    return granularity == "full"


def _coefficient(overrides: dict[str, Any], field: str, prefix: str) -> float:
    """A non-negative loss coefficient (absent or null: 0, the loss is off)."""
    value = overrides.get(field)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{prefix}.{field}", f"{value!r} is not a non-negative number")
    return float(value)
