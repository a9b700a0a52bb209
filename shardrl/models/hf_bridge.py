"""The one mapping between HF safetensors checkpoints and shardrl's sharded parameters.

Everything here is driven by the parameters' `ShardSpec`s (HF name, full shape, slice, expert ids); nothing routes
on parameter names. Loading reads only this rank's slice of each tensor (`safe_open(...).get_slice`), so no rank
materialises the full model. Export gathers TP/ETP shards, EP experts and pipeline stages back into full HF tensors;
weight sync and checkpoint conversion reuse it.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from shardrl.errors import UserError
from shardrl.models.config import FAMILY_PREFIX, ModelConfig
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import Layout
from shardrl.parallel.lora import (EXPERT_PARAMETERS, PEFT_PREFIX, PEFT_WEIGHTS, ExpertLoRA, LoRA, adapted_weights,
                                   lora_parameters, peft_expert_keys, stack_expert_adapter)
from shardrl.parallel.spec import ShardSpec, get_spec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
Model = nn.Module | Sequence[nn.Module]  # one stage, or the virtual-pipeline chunks this rank holds


class CheckpointError(UserError, ValueError):
    """A checkpoint does not fit the model; the message names the file and tensor."""


def checkpoint_tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the HF checkpoint directory `path`, from the safetensors headers alone (no tensor
    is read), checking what loading would trip over later on some rank: no weights file, a shard the index lists
    but that is missing, a header that does not parse, a file shorter than its header says. Raises
    CheckpointError naming the file."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({err})") from None
        files = sorted({path / name for name in weight_map.values()})
    elif (path / SINGLE_FILE).exists():
        files = [path / SINGLE_FILE]
    else:
        raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found; the model directory needs "
                              f"its weights in safetensors format")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: shard file listed in {INDEX_FILE} is missing")
        shapes |= _safetensors_header_shapes(file)
    return shapes


def model_tensor_shapes(config: ModelConfig, value_head: bool) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a model of `config` loads and exports -> its full shape (one entry per expert), from the
    model's own specs, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = Transformer(config, Layout.single("meta"), value_head=value_head)
    return {name: get_spec(param).full_shape for param in _unique_params(model) for name in get_spec(param).hf_names()}


def ignored_tensor(name: str, config: ModelConfig, value_head: bool) -> bool:
    """A checkpoint tensor that transformers also ignores when it loads the model: rotary `inv_freq` buffers, and
    `lm_head.weight` where the model ties it to the embedding or (`value_head`) replaces it with a value head."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and (config.tie_word_embeddings or
                                                                                    value_head))


def _safetensors_header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Shapes from one safetensors file's header: 8 bytes of header length (little-endian), the JSON header, then
    the data, whose extent the header's `data_offsets` give."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        header = f.read(length) if 0 < length <= size - 8 else b""
    try:
        entries = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
        end = max((v["data_offsets"][1] for v in entries.values()), default=0)
        shapes = {name: tuple(v["shape"]) for name, v in entries.items()}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError):
        raise CheckpointError(f"{file}: not a safetensors file (its header does not parse); write or download it "
                              f"again") from None
    if 8 + length + end > size:
        raise CheckpointError(f"{file}: truncated ({size} bytes, its header describes {8 + length + end}); "
                              f"download or copy it again")
    return shapes


class HFCheckpointReader:
    """Slices of the tensors of an HF checkpoint directory (one `model.safetensors` or a sharded index)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.path / file for name, file in weight_map.items()}
        elif (self.path / SINGLE_FILE).exists():
            with safe_open(self.path / SINGLE_FILE, "pt") as f:
                self.files = dict.fromkeys(f.keys(), self.path / SINGLE_FILE)
        else:
            raise CheckpointError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str, full_shape: tuple[int, ...], dim: int | None, start: int, stop: int) -> Tensor:
        """Rows [start, stop) along `dim` of tensor `name` (all of it for dim=None), checking its full shape."""
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        if file not in self._handles:
            if not file.exists():
                raise CheckpointError(f"{file}: shard file listed in {INDEX_FILE} is missing (holds {name!r})")
            self._handles[file] = safe_open(file, "pt")
        tensor = self._handles[file].get_slice(name)
        shape = tuple(tensor.get_shape())
        if shape != tuple(full_shape):
            raise CheckpointError(f"{file}: tensor {name!r} has shape {shape} but the model expects "
                                  f"{tuple(full_shape)} (does config.json match the weights?)")
        if dim is None:
            return tensor[:]
        return tensor[(slice(None),) * dim + (slice(start, stop),)]


def _unique_params(model: Model) -> list[nn.Parameter]:
    chunks = model if isinstance(model, Sequence) else [model]
    seen: dict[int, nn.Parameter] = {}
    for chunk in chunks:
        for param in chunk.parameters():
            seen.setdefault(id(param), param)
    return list(seen.values())


def _random_init(name: str, shape: tuple[int, ...], std: float) -> Tensor:
    """The same N(0, std) tensor on every rank and layout: the generator is seeded from the HF name."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def load_hf_weights(model: Model, source: str | Path | HFCheckpointReader, optional: Collection[str] = (),
                    init_std: float = 0.02) -> None:
    """Fill every parameter of `model` with its slice of the HF checkpoint at `source`.

    `optional`: HF names that may be absent (e.g. `score.weight` when a critic starts from a causal LM); those are
    initialised N(0, init_std), identically on every rank. Experts are read by their global ids. LoRA adapters
    are not tensors of a base model: they keep their initial values.
    """
    reader = source if isinstance(source, HFCheckpointReader) else HFCheckpointReader(source)
    absent = {name for name in optional if name not in reader}
    adapters = {id(p) for p in lora_parameters(model)}
    for param in (p for p in _unique_params(model) if id(p) not in adapters):
        spec = get_spec(param)
        start, stop = spec.slice_range() or (0, 0)
        for i, name in enumerate(spec.hf_names()):
            if name not in absent:
                _copy_piece(param[i] if spec.expert else param, spec,
                            reader.read(name, spec.full_shape, spec.dim, start, stop))
    init_hf_weights(model, absent, init_std)


@torch.no_grad()
def init_hf_weights(model: Model, names: Collection[str], init_std: float = 0.02) -> None:
    """Fill this rank's slices of the HF tensors `names` with N(0, init_std), identically on every rank and layout:
    the tensors a starting checkpoint (HF or distributed) may lack, like a critic's value head."""
    for param in _unique_params(model):
        spec = get_spec(param)
        for i, name in enumerate(spec.hf_names()):
            if name in names:
                _copy_piece(param[i] if spec.expert else param, spec,
                            _local_slice(_random_init(name, spec.full_shape, init_std), spec))


def _local_slice(full: Tensor, spec: ShardSpec) -> Tensor:
    """This rank's rows of one whole HF tensor (without the vocab padding)."""
    if spec.dim is None:
        return full
    start, stop = spec.slice_range()
    return full.narrow(spec.dim, start, stop - start)


def _copy_piece(dest: Tensor, spec: ShardSpec, piece: Tensor) -> None:
    if piece.shape != dest.shape:  # padded vocab rows past the real vocabulary stay zero
        dest.zero_()
        dest = dest.narrow(spec.dim, 0, piece.shape[spec.dim])
    dest.copy_(piece)


def hf_name_index(model: Model) -> dict[str, tuple[nn.Parameter, int]]:
    """Every HF tensor name the model's local shards cover -> (parameter, local expert index; 0 if not an expert)."""
    return {name: (param, i) for param in _unique_params(model) for i, name in enumerate(get_spec(param).hf_names())}


@torch.no_grad()
def load_hf_tensor(param: nn.Parameter, expert_index: int, full: Tensor) -> None:
    """Copy this rank's slice of `full` (one whole HF tensor, any device and dtype) into `param` (its
    `expert_index`-th local expert for expert params): `load_hf_weights` for tensors that arrive in memory."""
    spec = get_spec(param)
    if tuple(full.shape) != spec.full_shape:
        raise CheckpointError(f"tensor {spec.hf_names()[expert_index]!r} has shape {tuple(full.shape)} but the model "
                              f"expects {spec.full_shape}")
    _copy_piece(param[expert_index] if spec.expert else param, spec, _local_slice(full, spec))


def _exported(spec: ShardSpec, layout: Layout) -> bool:
    """A tied LM-head copy on a later pipeline stage repeats the first stage's embedding: export that one only."""
    return not (spec.tied_group and not layout.is_first_stage)


def _gather_full(param: Tensor, layout: Layout) -> Tensor:
    """This rank's shard -> the full tensor(s) [n, *full_shape] (n = number of experts, or 1). Collective over the
    spec's TP/ETP group and, for experts, the EP group."""
    spec = get_spec(param)
    full = param.detach() if spec.expert else param.detach().unsqueeze(0)  # [n_local, *shard_shape]
    if spec.dim is not None and spec.num_shards > 1:
        size = layout.size(spec.group)
        pieces = [torch.empty_like(full) for _ in range(size)]
        dist.all_gather(pieces, full.contiguous(), group=layout.group(spec.group))
        # Ranks sharing a shard (KV heads < TP) hold copies: take one per shard.
        full = torch.cat(pieces[:: size // spec.num_shards], dim=spec.dim + 1)
        full = full.narrow(spec.dim + 1, 0, spec.full_shape[spec.dim])  # drop vocab padding
    if spec.expert and layout.ep_size > 1:
        blocks = [torch.empty_like(full) for _ in range(layout.ep_size)]
        dist.all_gather(blocks, full.contiguous(), group=layout.ep_group)
        local_ids = torch.tensor(spec.expert_ids, device=full.device)
        ids = [torch.empty_like(local_ids) for _ in range(layout.ep_size)]
        dist.all_gather(ids, local_ids, group=layout.ep_group)
        full = torch.cat(blocks).index_select(0, torch.cat(ids).argsort())
    return full


def _global_names(spec: ShardSpec, layout: Layout) -> list[str]:
    if not spec.expert:
        return [spec.hf_name]
    return [spec.hf_name.format(expert=e) for e in range(len(spec.expert_ids) * layout.ep_size)]


@torch.no_grad()
def export_hf_weights(model: Model, layout: Layout,
                      adapters: Literal["separate", "merged", "only"] = "separate") -> Iterator[tuple[str, Tensor]]:
    """Yield `(hf_name, full tensor)` for the whole model, on every rank of the layout, in the same order.

    Collective over the layout: every rank must consume the iterator to the end. Pipeline stages take turns:
    the owning stage gathers each tensor over TP/ETP/EP, then broadcasts it over the PP group. Tensors are on
    `layout.device` in the parameters' dtype. LoRA adapters (`parallel.lora`): `separate` yields them beside the
    base weights under PEFT's names (checkpoints, tests), `merged` folds each into its base weight (W + s * B A,
    in fp32, then the weight's dtype: the trained model for transformers) and `only` yields the adapters alone (a
    PEFT adapter's tensors).
    """
    chunks = model if isinstance(model, Sequence) else [model]
    merges = adapted_weights(chunks) if adapters == "merged" else {}  # base weight -> its adapter's A, B, scale
    adapter_params = {id(p) for p in lora_parameters(chunks)}

    def wanted(param: nn.Parameter) -> bool:
        if not _exported(get_spec(param), layout):
            return False
        return adapters == "separate" or (id(param) in adapter_params) == (adapters == "only")

    params = [p for p in _unique_params(model) if wanted(p)]
    metas = [(_global_names(get_spec(p), layout), get_spec(p).full_shape, p.dtype) for p in params]

    def gathered(param: nn.Parameter) -> Tensor:
        tensor = _gather_full(param, layout)  # [n, out, in]: n experts, or 1
        if (merge := merges.get(id(param))) is not None:
            a, b, scale = merge
            delta = _gather_full(b, layout).float() @ _gather_full(a, layout).float()  # [n, out, r] @ [n, r, in]
            tensor = (tensor.float() + scale * delta).to(tensor.dtype)
        return tensor

    if layout.pp_size == 1:
        for param, (names, _, _) in zip(params, metas):
            yield from zip(names, gathered(param))
        return
    stage_metas: list = [None] * layout.pp_size
    dist.all_gather_object(stage_metas, metas, group=layout.pp_group)
    for stage, stage_params in enumerate(stage_metas):
        for i, (names, shape, dtype) in enumerate(stage_params):
            if stage == layout.pp_rank:
                full = gathered(params[i]).contiguous()
            else:
                full = torch.empty(len(names), *shape, dtype=dtype, device=layout.device)
            dist.broadcast(full, group=layout.pp_group, group_src=stage)
            yield from zip(names, full)


def save_hf_checkpoint(model: Model, layout: Layout, out_dir: str | Path, dtype: torch.dtype | None = None,
                       max_shard_bytes: int = 4 << 30) -> None:
    """Write `out_dir` as an HF checkpoint transformers can load (safetensors + config.json).

    Collective over the layout; the layout's first rank writes, holding at most one file's tensors in memory.
    A value-head model is saved as `<Family>ForSequenceClassification` with one label; LoRA adapters are merged
    into their weights (`save_peft_adapter` writes them on their own). `dtype` converts the tensors (default: as
    trained).
    """
    chunks = list(model) if isinstance(model, Sequence) else [model]
    writer = layout.local_rank == 0
    out_dir = Path(out_dir)
    files: list[tuple[Path, list[str], int]] = []
    part: dict[str, Tensor] = {}
    for name, tensor in export_hf_weights(chunks, layout, adapters="merged"):
        if not writer:
            continue
        if part and sum(t.nbytes for t in part.values()) + tensor.nbytes > max_shard_bytes:
            files.append(_write_part(part, out_dir, len(files)))
            part = {}
        part[name] = tensor.to("cpu", dtype or tensor.dtype, copy=True)
    if writer:
        files.append(_write_part(part, out_dir, len(files)))
        _finish(files, out_dir, _hf_config(chunks[0]))


def save_peft_adapter(model: Model, layout: Layout, out_dir: str | Path, base_model: str | None = None) -> None:
    """Write `out_dir` as a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) of the model's
    adapters, which `peft.PeftModel.from_pretrained` loads onto the base transformers model. Collective over the
    layout; the layout's first rank writes. `base_model`: recorded as the adapter's base model path. Expert
    adapters are written as PEFT's `target_parameters` adapters of transformers' stacked expert weights."""
    chunks = list(model) if isinstance(model, Sequence) else [model]
    modules = [m for chunk in chunks for m in chunk.modules()]
    linears = {(get_spec(m.weight).hf_name.removesuffix(".weight").rsplit(".", 1)[-1], m.lora.lora_A.shape[0],
                m.lora.scale) for m in modules if isinstance(getattr(m, "lora", None), LoRA)}
    experts = [(m.layer_id, m.parameter, get_spec(m.lora_A).hf_name, [get_spec(b).hf_name for b in m.lora_B],
                m.num_experts, m.lora_A.shape[1], m.scale) for m in modules if isinstance(m, ExpertLoRA)]
    stages: list = [(linears, experts)]
    if layout.pp_size > 1:  # every stage's adapted module names
        stages = [None] * layout.pp_size
        dist.all_gather_object(stages, (linears, experts), group=layout.pp_group)
    linears = set().union(*(stage[0] for stage in stages))
    experts = [entry for stage in stages for entry in stage[1]]
    shapes = {(r, s) for _, r, s in linears} | {(r, s) for *_, r, s in experts}
    if len(shapes) != 1:
        raise ValueError(f"save_peft_adapter: the model needs adapters of one rank and scale, found {sorted(shapes)}")
    (rank, scale), = shapes
    tensors = {name: t.to("cpu", copy=True) for name, t in export_hf_weights(chunks, layout, "only")}
    if layout.local_rank != 0:
        return
    targeted = [p for p in EXPERT_PARAMETERS if any(entry[1] == p for entry in experts)]  # PEFT's wrapping order
    peft_tensors = {}
    for layer_id, parameter, a_name, b_names, num_experts, _, _ in experts:
        def every_expert(template: str) -> Tensor:
            return torch.stack([tensors.pop(template.format(expert=e)) for e in range(num_experts)])

        a_key, b_key = peft_expert_keys(layer_id, parameter, targeted)
        peft_tensors[a_key], peft_tensors[b_key] = stack_expert_adapter(every_expert(a_name),
                                                                        [every_expert(b) for b in b_names])
    peft_tensors.update((PEFT_PREFIX + name, t) for name, t in tensors.items())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors, out_dir / PEFT_WEIGHTS, metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
              "target_modules": sorted({m for m, _, _ in linears}) or None, "target_parameters": targeted or None,
              "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "base_model_name_or_path": base_model, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _hf_config(stage: Transformer) -> dict:
    config = dict(stage.config.hf_config)
    if stage.value_head:
        config.update(architectures=[FAMILY_PREFIX[stage.config.family] + "ForSequenceClassification"],
                      num_labels=1)
    return config


def _write_part(part: dict[str, Tensor], out_dir: Path, number: int) -> tuple[Path, list[str], int]:
    """Write one file now (named for its final place once the number of files is known)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    file = out_dir / f"part-{number:05d}.safetensors"
    save_file(part, file, metadata={"format": "pt"})
    return file, list(part), sum(t.nbytes for t in part.values())


def _finish(files: list[tuple[Path, list[str], int]], out_dir: Path, config: dict) -> None:
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if len(files) == 1:
        files[0][0].replace(out_dir / SINGLE_FILE)
        return
    weight_map = {}
    for i, (file, names, _) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        file.replace(out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": sum(nbytes for *_, nbytes in files)}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
