"""How a rank's shards become DCP boxes: each parameter's (and its optimizer state's) local values as boxes of the
full HF tensors at their global offsets, and the DCP planners that write and read exactly those boxes.

Used by `checkpoint.py` (see its docstring for the format). Keys: ``model/<hf name>`` and
``optim/<master|exp_avg|exp_avg_sq>/<hf name>``, one full tensor per key (one per expert, vocab padding excluded).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardrl.parallel.data import counts_in_norm
from shardrl.parallel.layout import Layout
from shardrl.parallel.optimizer import AdamW
from shardrl.parallel.spec import ShardSpec, get_spec

MODEL_PREFIX = "model/"
OPTIM_STATES = ("master", "exp_avg", "exp_avg_sq")



@dataclass
class Piece:
    offsets: tuple[int, ...]  # of this box in the full HF tensor
    tensor: Tensor  # the box's values: a view of live model or optimizer state


@dataclass
class Entry:
    """One full HF tensor and the boxes of it this rank writes or reads."""

    full_shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


def flat_boxes(lo: int, hi: int, shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [lo, hi) of a row-major tensor of `shape` as boxes (offsets, sizes), in memory order: a partial
    first row, a block of whole rows, a partial last row (the partial rows cut recursively)."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first, last = -(-lo // inner), hi // inner  # whole rows [first, last)

    def row_part(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *o), (1, *s)) for o, s in flat_boxes(a, b, shape[1:])]

    if first > last:  # inside one row
        return row_part(last, lo - last * inner, hi - last * inner)
    boxes = row_part(first - 1, lo - (first - 1) * inner, inner) if lo < first * inner else []
    if first < last:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
    if hi > last * inner:
        boxes += row_part(last, 0, hi - last * inner)
    return boxes


def spec_pieces(spec: ShardSpec, flat: Tensor, lo: int, hi: int) -> Iterator[tuple[str, Piece]]:
    """(HF name, box) for elements [lo, hi) of the flattened local tensor of `spec`, whose values are `flat`
    [hi - lo]: split per expert, shifted to the shard's place in the full tensor, vocab padding dropped."""
    local = spec.local_shape()
    shard = local[1:] if spec.expert else local  # one expert's (or the only) shard
    per_expert = math.prod(shard)
    start, stop = spec.slice_range() or (0, 0)
    for i, name in enumerate(spec.hf_names()):
        a, b = max(lo, i * per_expert), min(hi, (i + 1) * per_expert)
        pos = a - lo
        for offsets, sizes in flat_boxes(a - i * per_expert, b - i * per_expert, shard):
            view = flat[pos:pos + math.prod(sizes)].view(sizes)
            pos += math.prod(sizes)
            if spec.dim is None:
                yield name, Piece(offsets, view)
                continue
            d = spec.dim
            rows = min(offsets[d] + sizes[d], stop - start) - offsets[d]  # rows of the box before the padding
            if rows > 0:
                yield name, Piece((*offsets[:d], offsets[d] + start, *offsets[d + 1:]), view.narrow(d, 0, rows))


def _writes(spec: ShardSpec, layout: Layout, dp_replicated: bool) -> bool:
    """Whether this rank writes its values of `spec`: the primary copy over TP replicas and tied stages (the copy
    the grad norm counts) and, when data-parallel replicas hold the same values, the first replica."""
    dp_group = "edp" if spec.expert else "dp_cp"
    return counts_in_norm(spec, layout) and (not dp_replicated or layout.rank(dp_group) == 0)


def unique_params(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    return list({id(p): p for chunk in chunks for p in chunk.parameters()}.values())


def _add(entries: dict[str, Entry], key: str, spec: ShardSpec, piece: Piece) -> None:
    entries.setdefault(key, Entry(spec.full_shape)).pieces.append(piece)


def model_entries(params: list[nn.Parameter], layout: Layout, writing: bool) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for param in params:
        spec = get_spec(param)
        if writing and not _writes(spec, layout, dp_replicated=True):
            continue
        for name, piece in spec_pieces(spec, param.detach().view(-1), 0, param.numel()):
            _add(entries, MODEL_PREFIX + name, spec, piece)
    return entries


def optimizer_entries(optimizer: AdamW, params: list[nn.Parameter], layout: Layout, writing: bool
                       ) -> tuple[dict[str, Entry], dict[str, Any]]:
    """Entries of the optimizer's master weights and moments, and its `state_dict()` (whose tensors they view)."""
    by_name = {get_spec(p).hf_name: p for p in params}
    state = optimizer.state_dict()
    entries: dict[str, Entry] = {}
    for name, owned in state["params"].items():
        spec = get_spec(by_name[name])
        if writing and not _writes(spec, layout, dp_replicated=not optimizer.grads.shard):
            continue
        lo, hi = owned["range"]
        for kind in OPTIM_STATES:
            for hf_name, piece in spec_pieces(spec, owned[kind], lo, hi):
                _add(entries, f"optim/{kind}/{hf_name}", spec, piece)
    return entries, state


class ShardSavePlanner(DefaultSavePlanner):
    """Writes each `Entry` piece as a shard at its global offsets and every other value as pickled bytes."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if not isinstance(value, Entry):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            for piece in value.pieces:
                offsets = torch.Size(piece.offsets)
                items.append(WriteItem(
                    index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, piece.tensor.shape),
                                                properties=TensorProperties.create_from_tensor(piece.tensor),
                                                size=torch.Size(value.full_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        if not isinstance(value, Entry):
            return value
        return next(p.tensor for p in value.pieces if p.offsets == tuple(index.offset)).contiguous()


class ShardLoadPlanner(DefaultLoadPlanner):
    """Reads into the pieces of each `Entry` (views of live state) and replaces other values by the saved ones."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, value in self.state_dict.items():
            if isinstance(value, Entry):
                chunks = [ChunkStorageMetadata(torch.Size(p.offsets), p.tensor.shape) for p in value.pieces]
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
            else:
                index, zero = MetadataIndex(key), torch.Size((0,))
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=zero,
                                      storage_index=index, storage_offsets=zero, lengths=zero))
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        return self.state_dict[index.fqn].pieces[index.index].tensor  # `index.index`: the piece's position

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=False)
