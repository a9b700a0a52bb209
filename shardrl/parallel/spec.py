"""Shard specs: how each local parameter relates to the full HF tensor(s) it is a piece of.

Every trainable parameter carries one (`param.shard_spec`). Loading, HF export, distributed checkpoints, weight sync,
gradient reduction and grad-norm clipping read these specs and nothing else: no code routes on parameter names.

Conventions
-----------
* ``full_shape`` is the shape of one HF tensor (for experts: of one expert's tensor).
* The local tensor is the ``index``-th of ``num_shards`` equal pieces of the full tensor along ``dim`` (after padding
  that dim to ``padded_dim_size`` when set, e.g. vocab rows padded to a multiple of TP). ``dim=None``: not split.
* ``group`` names the Layout group the shards live in (``"tp"`` for dense layers, ``"etp"`` for expert FFNs). When
  ``num_shards`` is smaller than that group's size, consecutive ranks hold the same shard (KV heads with
  ``num_kv_heads < TP``): rank ``r`` holds shard ``r // (group_size // num_shards)``.
* Experts: the local tensor has a leading dim of local experts; ``expert_ids[i]`` is the global id of local expert
  ``i`` and ``hf_name`` contains ``{expert}``, to be formatted with that id.
* ``sum_grad_over_group``: each rank of the shard group (TP for dense params, ETP for experts) computes only part of
  the gradient (sequence-parallel norms and MoE routers see only their rank's tokens; a LoRA factor kept whole
  beside a split weight sees only that rank's slice of the features), so gradients are summed over that group
  before data-parallel reduction. Shards replicated over part of the group (see above) always have their
  gradients summed over their replicas.
* ``tied_group``: the parameter has a twin on another pipeline stage (tied embedding and LM head); gradients are
  summed over the Layout's ``"embedding"`` group and only the first stage's copy is exported/counted.
* ``expert``: reduced over the expert-data-parallel group (``"edp"``) instead of ``"dp_cp"``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class ShardSpec:
    hf_name: str
    full_shape: tuple[int, ...]
    dim: int | None = None
    num_shards: int = 1
    index: int = 0
    padded_dim_size: int | None = None
    group: str | None = None
    expert_ids: tuple[int, ...] | None = None
    sum_grad_over_group: bool = False
    tied_group: bool = False

    @property
    def expert(self) -> bool:
        return self.expert_ids is not None

    def local_shape(self) -> tuple[int, ...]:
        """Shape of the local tensor this spec describes (with the leading expert dim for experts)."""
        shape = list(self.full_shape)
        if self.dim is not None:
            size = self.padded_dim_size or shape[self.dim]
            shape[self.dim] = size // self.num_shards
        if self.expert_ids is not None:
            shape.insert(0, len(self.expert_ids))
        return tuple(shape)

    def slice_range(self) -> tuple[int, int] | None:
        """[start, stop) of this shard along `dim` in the *unpadded* full tensor (stop clipped; may be empty)."""
        if self.dim is None:
            return None
        size = self.full_shape[self.dim]
        per_shard = (self.padded_dim_size or size) // self.num_shards
        start = self.index * per_shard
        return min(start, size), min(start + per_shard, size)

    def hf_names(self) -> list[str]:
        """The HF tensor names this local tensor covers (one per local expert for expert params)."""
        if self.expert_ids is None:
            return [self.hf_name]
        return [self.hf_name.format(expert=e) for e in self.expert_ids]

    def renamed(self, hf_name: str) -> ShardSpec:
        return replace(self, hf_name=hf_name)


def set_spec(param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Attach `spec` to `param` (checks the local shape so a wrong spec fails where it is made)."""
    if tuple(param.shape) != spec.local_shape():
        raise ValueError(f"{spec.hf_name}: local shape {tuple(param.shape)} != spec's {spec.local_shape()}")
    param.shard_spec = spec
    return param


def get_spec(param: torch.Tensor) -> ShardSpec:
    spec = getattr(param, "shard_spec", None)
    if spec is None:
        raise KeyError(f"parameter of shape {tuple(param.shape)} has no shard_spec")
    return spec
