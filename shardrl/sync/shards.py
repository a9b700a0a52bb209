"""Both ends of the transfer seen through their parameters' shard specs: what a rank holds or needs (`Slice`s for
the plan) and the tensor view of any box of an HF tensor inside its local shard.

Trainer parameters may be offloaded (`shardrl.parallel.offload`: device storage resized to 0, the bytes kept in a
pinned host copy); their boxes are then views of that host copy, read in place: nothing is reloaded to the device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from shardrl.models.hf_bridge import hf_name_index
from shardrl.parallel.spec import ShardSpec, get_spec
from shardrl.sync.plan import Box, Slice

Model = nn.Module | Sequence[nn.Module]


def shard_box(spec: ShardSpec) -> Box | None:
    """The box of the full (unpadded) HF tensor a shard covers; None when the shard is all padding."""
    box = [(0, size) for size in spec.full_shape]
    if spec.dim is not None:
        start, stop = spec.slice_range()
        if start == stop:
            return None
        box[spec.dim] = (start, stop)
    return tuple(box)


def box_view(local: Tensor, spec: ShardSpec, expert_index: int, box: Box) -> Tensor:
    """The view of `box` (in full-tensor coordinates) inside `local`, a tensor laid out like the parameter."""
    view = local[expert_index] if spec.expert else local
    shard_start = spec.slice_range()[0] if spec.dim is not None else 0
    for dim, (start, stop) in enumerate(box):
        view = view.narrow(dim, start - (shard_start if dim == spec.dim else 0), stop - start)
    return view


def _host_view(param: Tensor) -> Tensor | None:
    """The pinned host copy of an offloaded parameter, laid out like the parameter; None when it is on the device.
    offload.py keeps the whole storage's bytes in `_host_copy` while the device storage is resized to 0."""
    host = getattr(param, "_host_copy", None)
    if host is None or param.untyped_storage().nbytes() != 0:
        return None
    return host.view(param.dtype).as_strided(param.shape, param.stride(), param.storage_offset())


class Shards:
    """The HF tensors a model's local shards cover, by name. `sending`: the trainer side, which skips the tied
    LM-head copies of later pipeline stages (the first stage's embedding is the one exported, see spec.py)."""

    def __init__(self, model: Model, sending: bool = False, first_stage: bool = True) -> None:
        index = hf_name_index(model)
        self.params = {name: (param, i) for name, (param, i) in index.items()
                       if not (sending and get_spec(param).tied_group and not first_stage)}

    def slices(self) -> list[Slice]:
        out = []
        for name, (param, _) in self.params.items():
            spec = get_spec(param)
            box = shard_box(spec)
            if box is not None:
                out.append(Slice(name, spec.full_shape, box, param.dtype))
        return out

    def view(self, hf_name: str, box: Box) -> Tensor:
        """`box` of `hf_name` in this rank's shard: a device view, or a host view when the param is offloaded."""
        param, expert_index = self.params[hf_name]
        host = _host_view(param)
        return box_view(param.detach() if host is None else host, get_spec(param), expert_index, box)

    def padding(self) -> Iterator[Tensor]:
        """Views of the padded rows past the real vocabulary (kept zero, as the checkpoint loader leaves them)."""
        seen = set()
        for param, _ in self.params.values():
            spec = get_spec(param)
            if id(param) in seen or spec.dim is None or spec.padded_dim_size is None:
                continue
            seen.add(id(param))
            start, stop = spec.slice_range()
            dim = spec.dim + (1 if spec.expert else 0)
            if stop - start < param.shape[dim]:
                yield param.detach().narrow(dim, stop - start, param.shape[dim] - (stop - start))

    def offloaded(self) -> bool:
        return any(_host_view(param) is not None for param, _ in self.params.values())
