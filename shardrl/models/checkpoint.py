"""Layout-invariant distributed checkpoints of a model role: parameters, optimizer, scheduler, RNG and trainer state,
written with torch.distributed.checkpoint (DCP) and keyed by HF tensor names.

* Every tensor is stored as the full HF tensor it is a piece of (unpadded; one per expert) under
  ``model/<hf name>`` or ``optim/<master|exp_avg|exp_avg_sq>/<hf name>``. Each rank describes the boxes it holds at
  their global offsets (from the parameters' ShardSpecs) to DCP through its own planners, so no rank materialises
  the full model, and a checkpoint saved at one (TP, PP, VPP, EP, ETP, DP, distributed optimizer) layout loads at
  any other: DCP reads, for every box a rank needs, the overlapping parts of the saved boxes.
* Write once: of the ranks holding the same values (data-parallel replicas, KV heads or norms replicated over TP,
  the tied LM-head copy on the last stage) only the primary copy writes; loading fills every copy.
* Optimizer state: `AdamW.state_dict()` gives per HF name the range [lo, hi) of the flattened local tensor this rank
  owns (all of it, or its data-parallel chunk with the distributed optimizer). The range is cut into boxes of the
  local tensor, each a contiguous run of elements and so a view of the flat state, and shifted like the params.
* Vocab padding rows are neither saved nor read (loading zeroes them).
* Small objects (optimizer step count, scheduler, trainer state, each rank's RNG states) are pickled by DCP.
* Atomic: all ranks write into ``.<name>.tmp`` next to the target; the first rank adds the side files (HF config,
  tokenizer, `META_FILE`), fsyncs and renames it into place. `mark_latest` then points ``<root>/latest`` at a step.

Collective functions are called on every rank of the layout, whose ranks must be the whole default group.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
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

from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import CheckpointError
from shardrl.parallel.data import counts_in_norm
from shardrl.parallel.layout import Layout
from shardrl.parallel.optimizer import AdamW, LRScheduler
from shardrl.parallel.spec import ShardSpec, get_spec

MODEL_PREFIX = "model/"
OPTIM_STATES = ("master", "exp_avg", "exp_avg_sq")
META_FILE = "shardrl_checkpoint.json"
LATEST_FILE = "latest"
FORMAT_VERSION = 1
# Files next to config.json that make a checkpoint directory a usable HF model directory once weights are exported.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                 "chat_template.jinja")
_STEP_DIR = re.compile(r"global_step_(\d+)")


@dataclass
class _Piece:
    offsets: tuple[int, ...]  # of this box in the full HF tensor
    tensor: Tensor  # the box's values: a view of live model or optimizer state


@dataclass
class _Entry:
    """One full HF tensor and the boxes of it this rank writes or reads."""

    full_shape: tuple[int, ...]
    pieces: list[_Piece] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- boxes from specs
def _flat_boxes(lo: int, hi: int, shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [lo, hi) of a row-major tensor of `shape` as boxes (offsets, sizes), in memory order: a partial
    first row, a block of whole rows, a partial last row (the partial rows cut recursively)."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first, last = -(-lo // inner), hi // inner  # whole rows [first, last)

    def row_part(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *o), (1, *s)) for o, s in _flat_boxes(a, b, shape[1:])]

    if first > last:  # inside one row
        return row_part(last, lo - last * inner, hi - last * inner)
    boxes = row_part(first - 1, lo - (first - 1) * inner, inner) if lo < first * inner else []
    if first < last:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
    if hi > last * inner:
        boxes += row_part(last, 0, hi - last * inner)
    return boxes


def _pieces(spec: ShardSpec, flat: Tensor, lo: int, hi: int) -> Iterator[tuple[str, _Piece]]:
    """(HF name, box) for elements [lo, hi) of the flattened local tensor of `spec`, whose values are `flat`
    [hi - lo]: split per expert, shifted to the shard's place in the full tensor, vocab padding dropped."""
    local = spec.local_shape()
    shard = local[1:] if spec.expert else local  # one expert's (or the only) shard
    per_expert = math.prod(shard)
    start, stop = spec.slice_range() or (0, 0)
    for i, name in enumerate(spec.hf_names()):
        a, b = max(lo, i * per_expert), min(hi, (i + 1) * per_expert)
        pos = a - lo
        for offsets, sizes in _flat_boxes(a - i * per_expert, b - i * per_expert, shard):
            view = flat[pos:pos + math.prod(sizes)].view(sizes)
            pos += math.prod(sizes)
            if spec.dim is None:
                yield name, _Piece(offsets, view)
                continue
            d = spec.dim
            rows = min(offsets[d] + sizes[d], stop - start) - offsets[d]  # rows of the box before the padding
            if rows > 0:
                yield name, _Piece((*offsets[:d], offsets[d] + start, *offsets[d + 1:]), view.narrow(d, 0, rows))


def _writes(spec: ShardSpec, layout: Layout, dp_replicated: bool) -> bool:
    """Whether this rank writes its values of `spec`: the primary copy over TP replicas and tied stages (the copy
    the grad norm counts) and, when data-parallel replicas hold the same values, the first replica."""
    dp_group = "edp" if spec.expert else "dp_cp"
    return counts_in_norm(spec, layout) and (not dp_replicated or layout.rank(dp_group) == 0)


def _unique_params(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    return list({id(p): p for chunk in chunks for p in chunk.parameters()}.values())


def _add(entries: dict[str, _Entry], key: str, spec: ShardSpec, piece: _Piece) -> None:
    entries.setdefault(key, _Entry(spec.full_shape)).pieces.append(piece)


def _model_entries(params: list[nn.Parameter], layout: Layout, writing: bool) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for param in params:
        spec = get_spec(param)
        if writing and not _writes(spec, layout, dp_replicated=True):
            continue
        for name, piece in _pieces(spec, param.detach().view(-1), 0, param.numel()):
            _add(entries, MODEL_PREFIX + name, spec, piece)
    return entries


def _optimizer_entries(optimizer: AdamW, params: list[nn.Parameter], layout: Layout, writing: bool
                       ) -> tuple[dict[str, _Entry], dict[str, Any]]:
    """Entries of the optimizer's master weights and moments, and its `state_dict()` (whose tensors they view)."""
    by_name = {get_spec(p).hf_name: p for p in params}
    state = optimizer.state_dict()
    entries: dict[str, _Entry] = {}
    for name, owned in state["params"].items():
        spec = get_spec(by_name[name])
        if writing and not _writes(spec, layout, dp_replicated=not optimizer.grads.shard):
            continue
        lo, hi = owned["range"]
        for kind in OPTIM_STATES:
            for hf_name, piece in _pieces(spec, owned[kind], lo, hi):
                _add(entries, f"optim/{kind}/{hf_name}", spec, piece)
    return entries, state


@torch.no_grad()
def _zero_padding(params: list[nn.Parameter]) -> None:
    """Vocab rows past the real vocabulary hold zeros (no checkpoint stores them)."""
    for param in params:
        spec = get_spec(param)
        if spec.padded_dim_size is None:
            continue
        start, stop = spec.slice_range()
        dim = spec.dim + 1 if spec.expert else spec.dim
        real = stop - start
        param.narrow(dim, real, param.shape[dim] - real).zero_()


# ---------------------------------------------------------------------------------------------- DCP planners
class _SavePlanner(DefaultSavePlanner):
    """Writes each `_Entry` piece as a shard at its global offsets and every other value as pickled bytes."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if not isinstance(value, _Entry):
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
        if not isinstance(value, _Entry):
            return value
        return next(p.tensor for p in value.pieces if p.offsets == tuple(index.offset)).contiguous()


class _LoadPlanner(DefaultLoadPlanner):
    """Reads into the pieces of each `_Entry` (views of live state) and replaces other values by the saved ones."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, value in self.state_dict.items():
            if isinstance(value, _Entry):
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


# ---------------------------------------------------------------------------------------------- save
def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Where the trainer keeps the checkpoint of `step` (roles may save into sub-directories of it)."""
    return Path(root) / f"global_step_{step}"


def save_checkpoint(path: str | Path, chunks: Sequence[nn.Module], layout: Layout, *, optimizer: AdamW | None = None,
                    scheduler: LRScheduler | None = None, trainer_state: dict[str, Any] | None = None,
                    hf_dir: str | Path | None = None) -> Path:
    """Atomically write this role's checkpoint directory `path`; collective over the layout.

    `chunks`: this rank's model chunks (one per virtual pipeline stage). The optimizer's master weights and moments,
    the scheduler's position, `trainer_state` (small picklable values: step, data-loader position, ...) and every
    rank's RNG states are included when given. The HF config.json and, from `hf_dir`, the tokenizer files are stored
    alongside so `dist-to-hf` needs nothing else. An existing checkpoint at `path` is replaced.
    """
    path, coordinator = Path(path), _rank() == 0
    _check_world(layout)
    tmp = path.parent / f".{path.name}.tmp"
    if coordinator:
        if tmp.exists():  # left by a save that crashed
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    params = _unique_params(chunks)
    state: dict[str, Any] = {**_model_entries(params, layout, writing=True), f"rng/{_rank()}": _rng_state()}
    objects: dict[str, Any] = {}
    if optimizer is not None:
        state |= _optimizer_entries(optimizer, params, layout, writing=True)[0]
        objects["optimizer"] = {"num_steps": optimizer.num_steps}
    if scheduler is not None:
        objects["scheduler"] = scheduler.state_dict()
    if trainer_state is not None:
        objects["trainer"] = trainer_state
    if coordinator:
        state |= objects
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: supported
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=_SavePlanner())
    if coordinator:
        meta = dict(format_version=FORMAT_VERSION, world_size=_world(), layout=asdict(layout.spec),
                    distributed_optimizer=optimizer.grads.shard if optimizer is not None else None,
                    contents=["model", "rng", *objects])
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(chunks[0].config.hf_config, indent=2, sort_keys=True) + "\n")
        for name in HF_SIDE_FILES[1:]:
            if hf_dir is not None and (Path(hf_dir) / name).is_file():
                shutil.copyfile(Path(hf_dir) / name, tmp / name)
        _commit(tmp, path)
    _barrier()
    return path


def _commit(tmp: Path, path: Path) -> None:
    """Make `tmp` durable, then rename it to `path` (an older checkpoint there is moved aside first)."""
    for file in tmp.rglob("*"):
        if file.is_file():
            _fsync(file)
    _fsync(tmp)
    if path.exists():  # re-saving a step, e.g. after resuming from an earlier one
        old = path.parent / f".{path.name}.old"
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mark_latest(root: str | Path, step: int, max_to_keep: int | None = None) -> None:
    """Point `<root>/latest` at `checkpoint_dir(root, step)` (atomically replaced), then keep only the
    `max_to_keep` most recent step directories up to `step` (later ones belong to a run this one diverged from).
    Called by one process, after every role has saved."""
    root, target = Path(root), checkpoint_dir(root, step)
    if not target.is_dir():
        raise CheckpointError(f"{target}: no such checkpoint directory; save it before marking it latest")
    tmp = root / f".{LATEST_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(target.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST_FILE)
    _fsync(root)
    if max_to_keep is None:
        return
    if max_to_keep < 1:
        raise ValueError(f"max_ckpt_to_keep={max_to_keep}: keep at least 1 checkpoint, or None for all")
    steps = sorted(int(m[1]) for d in root.iterdir() if (m := _STEP_DIR.fullmatch(d.name)) and d.is_dir())
    keep = set([s for s in steps if s <= step][-max_to_keep:])
    for s in steps:
        if s not in keep:
            shutil.rmtree(checkpoint_dir(root, s))


def find_latest(root: str | Path) -> Path | None:
    """The directory `<root>/latest` names (for `trainer.resume_mode=auto`), or None when nothing was saved yet."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.exists():
        return None
    target = Path(root) / pointer.read_text().strip()
    if not target.is_dir():
        raise CheckpointError(f"{pointer} names {target}, which does not exist")
    return target


# ---------------------------------------------------------------------------------------------- load
def load_checkpoint(path: str | Path, chunks: Sequence[nn.Module], layout: Layout, *,
                    optimizer: AdamW | None = None, scheduler: LRScheduler | None = None,
                    restore_rng: bool = True) -> dict[str, Any] | None:
    """Load a checkpoint saved by `save_checkpoint` at any layout into this rank's `chunks` (and the optimizer's
    master weights and moments, the scheduler, the RNG states when asked); collective over the layout.

    Returns the saved `trainer_state` (None if none was saved). RNG states are per rank: at another world size,
    rank r takes those of saved rank r % saved world size.
    """
    path = Path(path)
    _check_world(layout)
    params = _unique_params(chunks)
    meta = _read_meta(path, chunks[0].config, optimizer is not None)
    state: dict[str, Any] = _model_entries(params, layout, writing=False)
    optim_state: dict[str, Any] = {}
    if optimizer is not None:
        entries, optim_state = _optimizer_entries(optimizer, params, layout, writing=False)
        state |= entries | {"optimizer": None}
    if scheduler is not None:
        state["scheduler"] = None
    if "trainer" in meta["contents"]:
        state["trainer"] = None
    rng_key = f"rng/{_rank() % meta['world_size']}"
    if restore_rng:
        state[rng_key] = None
    _agree(_check_keys(path, state))
    _zero_padding(params)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: supported
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=_LoadPlanner())
    if optimizer is not None:
        # The state was read into the optimizer's own tensors; this sets the step count and publishes the master
        # weights into the model (over DP with the distributed optimizer).
        optimizer.load_state_dict({"num_steps": state["optimizer"]["num_steps"], "params": optim_state["params"]})
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _set_rng_state(state[rng_key])
    return state.get("trainer")


def load_model_from_dist(chunks: Sequence[nn.Module], layout: Layout, path: str | Path) -> None:
    """Fill this rank's model chunks from a distributed checkpoint (`use_dist_checkpointing`: one written by
    `python -m shardrl.models.convert hf-to-dist`, or a training checkpoint); parameters only. Collective."""
    load_checkpoint(path, chunks, layout, restore_rng=False)


def saved_model_tensors(path: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """HF name -> (full shape, dtype) of every model tensor in the checkpoint at `path`."""
    metadata = _read_dcp_metadata(Path(path))
    return {key[len(MODEL_PREFIX):]: (tuple(md.size), md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}


def _read_dcp_metadata(path: Path) -> Metadata:
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: no distributed checkpoint here (no .metadata file)")
    return dcp.FileSystemReader(path).read_metadata()


def _read_meta(path: Path, config: ModelConfig, need_optimizer: bool) -> dict[str, Any]:
    """The checkpoint's `META_FILE`, after checking the directory, the architecture and the optimizer state (every
    rank sees the same files, so every rank raises)."""
    if not (path / ".metadata").is_file() or not (path / META_FILE).is_file():
        raise CheckpointError(f"{path}: no shardrl checkpoint here (missing .metadata or {META_FILE})")
    meta = json.loads((path / META_FILE).read_text())
    if (path / "config.json").is_file():
        saved = ModelConfig.from_pretrained(path)
        if saved.family != config.family:
            raise CheckpointError(f"{path}: checkpoint of a {saved.architecture} model; this model is a "
                                  f"{config.architecture}")
    if need_optimizer and "optimizer" not in meta["contents"]:
        raise CheckpointError(f"{path}: holds no optimizer state (contents: {', '.join(meta['contents'])}); load "
                              f"it without an optimizer, or with load_model_from_dist")
    return meta


def _check_keys(path: Path, state: dict[str, Any]) -> str | None:
    """An error line for the first key this rank needs that the checkpoint lacks or stores with another shape."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, value in state.items():
        if key not in saved:
            return f"{path}: {key!r} is missing from the checkpoint"
        if isinstance(value, _Entry) and tuple(getattr(saved[key], "size", ())) != value.full_shape:
            return (f"{path}: tensor {key!r} has shape {tuple(getattr(saved[key], 'size', ()))} in the checkpoint "
                    f"but the model expects {value.full_shape}")
    return None


def _agree(error: str | None) -> None:
    """Raise `error` on every rank if any rank found one (a rank raising alone would leave the others blocked in
    the next collective)."""
    if dist.is_initialized():
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise CheckpointError(error)


# ---------------------------------------------------------------------------------------------- process helpers
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _check_world(layout: Layout) -> None:
    if layout.spec.world_size != _world():
        raise CheckpointError(f"layout of {layout.spec.world_size} ranks in a world of {_world()}: checkpoints are "
                              f"collective over the default group, so the layout must span all of it")


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
