"""Rotary position embeddings (default, linear and Llama-3 scaled frequencies), computed from `position_ids`."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from shardrl.models.config import RopeConfig
from shardrl.models.fast_paths import elementwise


def inv_frequencies(rope: RopeConfig, head_dim: int) -> Tensor:
    """Inverse frequency of each rotated pair of channels, [head_dim/2] fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: Tensor, rope: RopeConfig) -> Tensor:
    """Llama 3.1: keep short wavelengths, divide long ones by `factor`, interpolate smoothly in between."""
    wavelength = 2 * math.pi / inv_freq
    short = rope.original_max_position_embeddings / rope.high_freq_factor  # wavelengths below this stay
    long = rope.original_max_position_embeddings / rope.low_freq_factor  # wavelengths above this are scaled
    smooth = (rope.original_max_position_embeddings / wavelength - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)  # 1 at `short`, 0 at `long`
    interpolated = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = torch.where(wavelength > long, inv_freq / rope.factor, inv_freq)
    middle = (wavelength >= short) & (wavelength <= long)
    return torch.where(middle, interpolated, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        super().__init__()
        # Not a parameter and not saved: it is derived from the config, like HF's.
        self.register_buffer("inv_freq", inv_frequencies(rope, head_dim).to(device), persistent=False)

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """position_ids [T] -> (cos, signed_sin), each [T, head_dim] fp32; the two halves of the channels repeat,
        and the first half of `signed_sin` is negated (the sign `apply_rope` needs, folded in once per forward)."""
        angles = position_ids.float().unsqueeze(-1) * self.inv_freq  # [T, D/2]
        sin = angles.sin()
        return torch.cat([angles, angles], dim=-1).cos(), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x [T, heads, D], cos and signed_sin [T, D] in x's dtype: rotate channel i with channel i + D/2 by the
    position's angle, x * cos + [-x2, x1] * sin, written as x * cos + roll(x, D/2) * signed_sin: a roll instead of a
    negation and a concatenation, and bit for bit the same (negating a factor is exact)."""
    cos, signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)  # [T, 1, D]
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rotate(q: Tensor, k: Tensor, cos: Tensor, signed_sin: Tensor, compile: bool) -> tuple[Tensor, Tensor]:
    """q [T, nq, D] and k [T, nkv, D] rotated by each token's angles (cos, signed_sin [T, D] fp32). The one device
    switch: CUDA runs one fused kernel per tensor in fp32 (`rope_kernel.py`); everything else `apply_rope` in the
    tensors' dtype (compiled when `compile`), the reference the tests compare against."""
    if q.is_cuda:
        from shardrl.models.rope_kernel import rotary  # Triton: CUDA installs only

        return rotary(q, cos, signed_sin), rotary(k, cos, signed_sin)
    cos, signed_sin = cos.to(q.dtype), signed_sin.to(q.dtype)  # converted once for both q and k
    rope = elementwise(apply_rope, compile)
    return rope(q, cos, signed_sin), rope(k, cos, signed_sin)
