"""Both ends of the transfer seen through their parameters' shard specs: what a rank holds or needs (`Slice`s for
the plan) and the tensor view of any box of an HF tensor inside its local shard.

Trainer parameters may be offloaded (`shardrl.parallel.offload`: device storage resized to 0, the bytes kept in a
pinned host copy, in the `HostBuffers` the trainer passes here); their boxes are then views of that host copy, read
in place: nothing is reloaded to the device.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence

from torch import Tensor, nn

from shardrl.parallel.lora import lora_parameters
from shardrl.parallel.offload import HostBuffers
from shardrl.parallel.spec import ShardSpec, get_spec
from shardrl.sync.plan import Box, Slice

Model = nn.Module | Sequence[nn.Module]


def shard_box(spec: ShardSpec) -> Box | None:
    """The box of the full (unpadded) HF tensor a shard covers, with a leading dim of global expert ids for expert
    params; None when the shard is all padding."""
    box = [(0, size) for size in spec.full_shape]
    if spec.dim is not None:
        start, stop = spec.slice_range()
        if start == stop:
            return None
        box[spec.dim] = (start, stop)
    if spec.expert:
        first, count = spec.expert_ids[0], len(spec.expert_ids)
        if spec.expert_ids != tuple(range(first, first + count)):
            raise ValueError(f"{spec.hf_name}: local experts {spec.expert_ids} are not a contiguous run of ids")
        box.insert(0, (first, first + count))
    return tuple(box)


def box_view(local: Tensor, spec: ShardSpec, box: Box) -> Tensor:
    """The view of `box` (full-tensor coordinates, see `shard_box`) inside `local`, laid out like the parameter."""
    view, lead = local, 0
    if spec.expert:
        start, stop = box[0]
        view, lead, box = view.narrow(0, start - spec.expert_ids[0], stop - start), 1, box[1:]
    shard_start = spec.slice_range()[0] if spec.dim is not None else 0
    for dim, (start, stop) in enumerate(box):
        offset = start - (shard_start if dim == spec.dim else 0)
        if offset or stop - start != view.shape[lead + dim]:  # a whole dim needs no narrow (the host pays ~5 us each)
            view = view.narrow(lead + dim, offset, stop - start)
    return view


class Shards:
    """A model's local shards by HF name (expert params by their name template). `sending`: the trainer side, which
    skips the tied LM-head copies of later pipeline stages (the first stage's embedding is the one exported,
    see spec.py). `host`: where the model's offloaded params are (None: the model is never offloaded, as the rollout's
    shards, which are only written on the device)."""

    def __init__(self, model: Model, sending: bool = False, first_stage: bool = True,
                 host: HostBuffers | None = None) -> None:
        self.host = host
        chunks = model if isinstance(model, Sequence) else [model]
        unique = {id(p): p for chunk in chunks for p in chunk.parameters()}.values()
        # LoRA adapters (`parallel.lora`): with the base frozen, what a sync after the first one has to move.
        self.adapters = {get_spec(p).hf_name for p in lora_parameters(chunks)}
        self.params: dict[str, nn.Parameter] = {}
        for param in unique:
            spec = get_spec(param)
            if sending and spec.tied_group and not first_stage:
                continue
            if spec.hf_name in self.params:
                raise ValueError(f"{spec.hf_name}: two parameters of this rank claim the same HF tensor")
            self.params[spec.hf_name] = param

    def adapters_only(self) -> Shards:
        """The same shards less everything but the LoRA adapters (what a sync of a LoRA model moves after its
        first)."""
        subset = copy.copy(self)
        subset.params = {name: p for name, p in self.params.items() if name in self.adapters}
        return subset

    def slices(self) -> list[Slice]:
        out = []
        for name, param in self.params.items():
            spec = get_spec(param)
            box = shard_box(spec)
            if box is not None:
                out.append(Slice(name, spec.full_shape, box, param.dtype, spec.expert))
        return out

    def view(self, hf_name: str, box: Box) -> Tensor:
        """`box` of `hf_name` in this rank's shard: a device view, or a host view when the param is offloaded."""
        param = self.params[hf_name]
        host = self._host_view(param)
        return box_view(param.detach() if host is None else host, get_spec(param), box)

    def offloaded(self, hf_name: str) -> bool:
        """Whether `view` of this tensor reads the pinned host copy (the param is offloaded)."""
        return self._host_view(self.params[hf_name]) is not None

    def _host_view(self, param: Tensor) -> Tensor | None:
        return None if self.host is None else self.host.host_view(param)

    def padding(self) -> Iterator[Tensor]:
        """Views of the padded rows past the real vocabulary (kept zero, as the checkpoint loader leaves them)."""
        for param in self.params.values():
            spec = get_spec(param)
            if spec.dim is None or spec.padded_dim_size is None:
                continue
            start, stop = spec.slice_range()
            dim = spec.dim + (1 if spec.expert else 0)
            if stop - start < param.shape[dim]:
                yield param.detach().narrow(dim, stop - start, param.shape[dim] - (stop - start))

    def largest_bytes(self) -> int:
        return max((param.numel() * param.element_size() for param in self.params.values()), default=0)
