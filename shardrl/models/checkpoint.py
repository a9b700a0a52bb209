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
* Vocab padding rows are neither saved nor read (loading zeroes them and their optimizer state).
* A model with LoRA adapters checkpoints what trains (the adapters, and a LoRA critic's value head) and its
  optimizer state: the frozen base comes from `model.path` at every start (`checkpointed_params`).
* Small objects (optimizer step count, scheduler, trainer state, each rank's RNG states) are pickled by DCP.
* Atomic: all ranks write into ``.<name>.tmp`` next to the target; the first rank adds the side files (HF config,
  tokenizer, `META_FILE`), fsyncs and renames it into place. `mark_latest` then points ``<root>/latest`` at a step.
* Parts (verl's `checkpoint.save_contents` / `load_contents`): "model" (the weights), "optimizer" (master weights,
  moments, step count) and "extra" (the scheduler's position, the RNG states) are saved and loaded as asked;
  "hf_model" names the HF export, which `save_hf_checkpoint` writes and nothing here reads.

Collective functions are called on every rank of the layout and communicate over its "world" group only, so a role
whose ranks are part of a larger world (a trainer pool beside a detached rollout pool) checkpoints alone.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardrl.models.checkpoint_shards import (
    MODEL_PREFIX,
    Entry,
    ShardLoadPlanner,
    ShardSavePlanner,
    model_entries,
    optimizer_entries,
    unique_params,
)
from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import CheckpointError, init_hf_weights
from shardrl.parallel.layout import Layout
from shardrl.parallel.lora import lora_parameters
from shardrl.parallel.optimizer import AdamW, LRScheduler

META_FILE = "shardrl_checkpoint.json"
LATEST_FILE = "latest"
FORMAT_VERSION = 1
# Files an HF model directory keeps next to config.json (tokenizer, generation defaults), carried along so an
# exported checkpoint is a complete model directory.
HF_EXTRA_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
_STEP_DIR = re.compile(r"global_step_(\d+)")
CHECKPOINT_PARTS = ("model", "optimizer", "extra")  # what save and load handle by default: all of it
KNOWN_PARTS = (*CHECKPOINT_PARTS, "hf_model")


# ---------------------------------------------------------------------------------------------- save
def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Where the trainer keeps the checkpoint of `step` (roles may save into sub-directories of it)."""
    return Path(root) / f"global_step_{step}"


def save_checkpoint(path: str | Path, chunks: Sequence[nn.Module], layout: Layout, *, optimizer: AdamW | None = None,
                    scheduler: LRScheduler | None = None, trainer_state: dict[str, Any] | None = None,
                    hf_dir: str | Path | None = None, rng: bool = True,
                    contents: Collection[str] = CHECKPOINT_PARTS) -> Path:
    """Atomically write this role's checkpoint directory `path`; collective over the layout.

    `chunks`: this rank's model chunks (one per virtual pipeline stage). The optimizer's master weights and moments,
    the scheduler's position and `trainer_state` (small picklable values: step, data-loader position, ...) are
    included when given, every rank's RNG states when `rng`. `contents` (verl's `save_contents`) narrows that to
    the parts it lists: weights with "model", the optimizer with "optimizer", scheduler and RNG with "extra".
    `trainer_state` is written whenever given, whatever `contents` says: a resume needs it (verl's trainer, too,
    saves its data-loader state apart from the contents). The HF config.json and, from `hf_dir`, the tokenizer
    files are stored alongside so `dist-to-hf` needs nothing else. An existing checkpoint at `path` is replaced.
    """
    parts = _parts(contents, "save_contents")
    save_rng, save_optimizer = rng and "extra" in parts, optimizer is not None and "optimizer" in parts
    path, coordinator, group = Path(path), layout.local_rank == 0, layout.group("world")
    tmp = path.parent / f".{path.name}.tmp"
    if coordinator:
        if tmp.exists():  # left by a save that crashed
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier(group)
    params = checkpointed_params(chunks)
    state: dict[str, Any] = model_entries(params, layout, writing=True) if "model" in parts else {}
    if save_rng:
        state[f"rng/{layout.local_rank}"] = _rng_state()
    objects: dict[str, Any] = {}
    if save_optimizer:
        state |= optimizer_entries(optimizer, params, layout, writing=True)[0]
        objects["optimizer"] = {"num_steps": optimizer.num_steps}
    if scheduler is not None and "extra" in parts:
        objects["scheduler"] = scheduler.state_dict()
    if trainer_state is not None:
        objects["trainer"] = trainer_state
    if coordinator:
        state |= objects
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: supported
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=ShardSavePlanner(), process_group=group,
                 no_dist=group is None)
    if coordinator:
        meta = dict(format_version=FORMAT_VERSION, world_size=layout.spec.world_size, layout=asdict(layout.spec),
                    distributed_optimizer=optimizer.grads.shard if save_optimizer else None,
                    lora_adapters_only=len(params) < len(unique_params(chunks)),
                    contents=[*(["model"] if "model" in parts else []), *(["rng"] if save_rng else []), *objects])
        _write_side_files(tmp, meta, chunks[0].config.hf_config, hf_dir)
        commit_directory(tmp, path)
    _barrier(group)
    return path


def _write_side_files(directory: Path, meta: dict[str, Any], hf_config: dict[str, Any],
                      hf_dir: str | Path | None) -> None:
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if hf_dir is not None:
        copy_hf_extra_files(Path(hf_dir), directory)


def copy_hf_extra_files(source: Path, dest: Path) -> None:
    """Copy the `HF_EXTRA_FILES` that `source` has into `dest`."""
    for name in HF_EXTRA_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)


def commit_directory(tmp: Path, path: Path) -> None:
    """Make `tmp` durable, then rename it to `path`. An older directory at `path` (a step saved again, e.g. after
    resuming from an earlier one; an earlier HF export) is moved aside first and deleted after."""
    for file in tmp.rglob("*"):
        if file.is_file():
            _fsync(file)
    _fsync(tmp)
    old = path.parent / f".{path.name}.old"
    if old.exists():  # left by a crash inside an earlier commit
        shutil.rmtree(old)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    _fsync(path.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mark_latest(root: str | Path, step: int, max_to_keep: int | Mapping[str, int | None] | None = None) -> None:
    """Point `<root>/latest` at `checkpoint_dir(root, step)` (atomically replaced), then prune: with an int, keep
    only the `max_to_keep` most recent step directories up to `step` (later ones belong to a run this one diverged
    from); with a mapping role -> count (verl's max_actor_ckpt_to_keep, max_critic_ckpt_to_keep), the same per role,
    see `prune_roles`. None keeps everything. Called by one process, after every role has saved."""
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
    if isinstance(max_to_keep, Mapping):
        prune_roles(root, step, max_to_keep)
        return
    _check_keep("max_ckpt_to_keep", max_to_keep)
    steps = _saved_steps(root)
    keep = [s for s in steps if s <= step][-max_to_keep:]  # `steps` is sorted
    for s in steps:
        if s not in keep:
            shutil.rmtree(checkpoint_dir(root, s))


def prune_roles(root: str | Path, step: int, max_to_keep: Mapping[str, int | None]) -> None:
    """Keep, of each role in `max_to_keep` (a sub-directory name of the step directories, e.g. "actor"), its
    directories in the newest `max_to_keep[role]` step directories up to `step` that hold one (None: all); later
    steps' (a run this one diverged from) go. A role's HF export beside it (`<role>_hf`) goes with it. A step
    directory left with none of these roles goes entirely; `step` itself keeps every role, as every count is >= 1.
    """
    root = Path(root)
    for role, keep in max_to_keep.items():
        _check_keep(f"max_{role}_ckpt_to_keep", keep)
    steps = _saved_steps(root)
    for role, keep in max_to_keep.items():
        if keep is None:
            continue
        holding = [s for s in steps if (checkpoint_dir(root, s) / role).is_dir()]
        kept = [s for s in holding if s <= step][-keep:]  # `steps` is sorted
        for s in holding:
            if s not in kept:
                for directory in (checkpoint_dir(root, s) / role, checkpoint_dir(root, s) / f"{role}_hf"):
                    if directory.is_dir():
                        shutil.rmtree(directory)
    for s in steps:
        if s != step and not any((checkpoint_dir(root, s) / role).is_dir() for role in max_to_keep):
            shutil.rmtree(checkpoint_dir(root, s))


def _check_keep(key: str, keep: int | None) -> None:
    if keep is not None and keep < 1:
        raise ValueError(f"{key}={keep}: keep at least 1 checkpoint, or None for all")


def _saved_steps(root: Path) -> list[int]:
    """The steps of the step directories under `root`, sorted."""
    return sorted(step for d in root.iterdir() if (step := step_of(d)) is not None and d.is_dir())


def step_of(path: str | Path) -> int | None:
    """The step of a directory named as `checkpoint_dir` names them, else None."""
    match = _STEP_DIR.fullmatch(Path(path).name)
    return int(match[1]) if match else None


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
                    restore_rng: bool = True, skip: Collection[str] = (),
                    contents: Collection[str] = CHECKPOINT_PARTS) -> dict[str, Any] | None:
    """Load a checkpoint saved by `save_checkpoint` at any layout into this rank's `chunks` (and the optimizer's
    master weights and moments, the scheduler, the RNG states when asked); collective over the layout. `skip`: HF
    names of model tensors not to read (they are left zero).

    `contents` (verl's `load_contents`) narrows what is read to the parts it lists; "model" is required, since a
    resume without the weights is not a resume. Without "optimizer" the optimizer's moments and step count are left
    as they are and its master weights are taken from the loaded weights; without "extra" the scheduler and the RNG
    states are left as they are. A part asked for that the checkpoint does not hold is an error.

    Returns the saved `trainer_state` (None if none was saved). RNG states are per rank: at another world size,
    rank r takes those of saved rank r % saved world size.
    """
    parts = _parts(contents, "load_contents")
    if "model" not in parts:
        raise ValueError(f"load_contents={sorted(parts)}: must include 'model'; a resume without the weights is "
                         f"not a resume")
    load_optimizer = optimizer is not None and "optimizer" in parts
    load_scheduler = scheduler is not None and "extra" in parts
    load_rng = restore_rng and "extra" in parts
    path, group = Path(path), layout.group("world")
    params = checkpointed_params(chunks)
    meta = _read_meta(path, chunks[0].config, load_optimizer, load_scheduler)
    state: dict[str, Any] = {key: entry for key, entry in model_entries(params, layout, writing=False).items()
                             if key[len(MODEL_PREFIX):] not in skip}
    if load_optimizer:
        entries, optim_state = optimizer_entries(optimizer, params, layout, writing=False)
        state |= entries | {"optimizer": None}
    if load_scheduler:
        state["scheduler"] = None
    if "trainer" in meta["contents"]:
        state["trainer"] = None
    rng_key = f"rng/{layout.local_rank % meta['world_size']}"
    if load_rng:
        state[rng_key] = None
    _agree(_check_keys(path, state), group)
    with torch.no_grad():  # what no checkpoint stores (vocab padding rows and their state) is zero
        for tensor in [*params, *(optimizer.state_tensors() if load_optimizer else [])]:
            tensor.zero_()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: supported
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=ShardLoadPlanner(), process_group=group,
                 no_dist=group is None)
    if load_optimizer:
        # The state was read into the optimizer's own tensors; this sets the step count and publishes the master
        # weights into the model (over DP with the distributed optimizer).
        optimizer.load_state_dict({"num_steps": state["optimizer"]["num_steps"], "params": optim_state["params"]})
    elif optimizer is not None:
        optimizer.copy_params_to_master()  # or the next update would bring back the weights it was built with
    if load_scheduler:
        scheduler.load_state_dict(state["scheduler"])
    if load_rng:
        _set_rng_state(state[rng_key])
    return state.get("trainer")


def checkpointed_params(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The parameters a checkpoint holds: all of them, or with LoRA adapters (`parallel.lora`) those that train (the
    adapters, and a critic's value head): the frozen base is the model the run loads from `model.path` and never
    changes."""
    params = unique_params(chunks)
    if next(lora_parameters(chunks), None) is None:
        return params
    return [p for p in params if p.requires_grad]


def _parts(contents: Collection[str], key: str) -> set[str]:
    """`contents` as a set, checked against the part names verl's `checkpoint.<key>` takes."""
    unknown = sorted(set(contents) - set(KNOWN_PARTS))
    if unknown:
        raise ValueError(f"{key}: unknown part {unknown[0]!r}; expected some of {', '.join(KNOWN_PARTS)}")
    return set(contents)


def load_model_from_dist(chunks: Sequence[nn.Module], layout: Layout, path: str | Path,
                         optional: Collection[str] = ()) -> None:
    """Fill this rank's model chunks from a distributed checkpoint (`use_dist_checkpointing`: one written by
    `python -m shardrl.models.convert hf-to-dist`, or a training checkpoint); parameters only. Collective.
    `optional`: HF names the checkpoint may lack (a critic's value head when it was converted from a causal LM);
    those are initialised as `load_hf_weights` initialises them."""
    absent = set(optional).difference(saved_model_tensors(path)) if optional else set()
    load_checkpoint(path, chunks, layout, restore_rng=False, skip=absent)
    init_hf_weights(chunks, absent)


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


def _read_meta(path: Path, config: ModelConfig, need_optimizer: bool, need_scheduler: bool) -> dict[str, Any]:
    """The checkpoint's `META_FILE`, after checking the directory, the architecture and that it holds the weights
    and the optimizer and scheduler state asked for (every rank sees the same files, so every rank raises)."""
    if not (path / ".metadata").is_file() or not (path / META_FILE).is_file():
        raise CheckpointError(f"{path}: no shardrl checkpoint here (missing .metadata or {META_FILE})")
    meta = json.loads((path / META_FILE).read_text())
    if (path / "config.json").is_file():
        saved = ModelConfig.from_pretrained(path)
        if saved.family != config.family:
            raise CheckpointError(f"{path}: checkpoint of a {saved.architecture} model; this model is a "
                                  f"{config.architecture}")
    held = ", ".join(meta["contents"]) or "nothing"
    if "model" not in meta["contents"]:
        raise CheckpointError(f"{path}: holds no model weights (contents: {held}), so nothing can resume from it; "
                              f"save with 'model' in save_contents")
    if need_optimizer and "optimizer" not in meta["contents"]:
        raise CheckpointError(f"{path}: holds no optimizer state (contents: {held}); load it without an optimizer, "
                              f"or with load_model_from_dist")
    if need_scheduler and "scheduler" not in meta["contents"]:
        raise CheckpointError(f"{path}: holds no LR scheduler state, part 'extra' (contents: {held}); load it "
                              f"without 'extra' in load_contents")
    return meta


def _check_keys(path: Path, state: dict[str, Any]) -> str | None:
    """An error line for the first key this rank needs that the checkpoint lacks or stores with another shape."""
    saved = _read_dcp_metadata(path).state_dict_metadata
    for key, value in state.items():
        if key not in saved:
            return f"{path}: {key!r} is missing from the checkpoint"
        if isinstance(value, Entry):
            shape = tuple(saved[key].size) if isinstance(saved[key], TensorStorageMetadata) else "not a tensor"
            if shape != value.full_shape:
                return (f"{path}: tensor {key!r} has shape {shape} in the checkpoint but the model expects "
                        f"{value.full_shape}")
    return None


def _agree(error: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise `error` on every rank of the layout if any rank found one (a rank raising alone would leave the others
    blocked in the next collective)."""
    if group is not None:
        errors: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        error = next((e for e in errors if e), None)
    if error:
        raise CheckpointError(error)


# ---------------------------------------------------------------------------------------------- process helpers
def _barrier(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group=group)


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
