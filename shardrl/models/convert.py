"""Convert between HF checkpoints and shardrl distributed checkpoints (the `use_dist_checkpointing` workflow).

    python -m shardrl.models.convert hf-to-dist --hf HF_DIR --out DIST_DIR [--dtype bfloat16]
    python -m shardrl.models.convert dist-to-hf --dist DIST_DIR --out HF_DIR [--config CONFIG] [--dtype bfloat16]

Both run in one process without torch.distributed, building the whole model once on CPU. `hf-to-dist` writes the
parameters only, keyed by HF names like a training checkpoint, with config.json and the tokenizer files alongside;
workers then read their shards at any layout with `checkpoint.load_model_from_dist`. `dist-to-hf` takes such a
directory or a training checkpoint and writes safetensors + config.json (+ tokenizer files) that transformers loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from shardrl.models.checkpoint import (
    META_FILE,
    copy_hf_extra_files,
    load_model_from_dist,
    save_checkpoint,
    saved_model_tensors,
)
from shardrl.models.config import ModelConfig, ModelConfigError
from shardrl.models.hf_bridge import CheckpointError, HFCheckpointReader, load_hf_weights, save_hf_checkpoint
from shardrl.models.transformer import VALUE_HEAD_NAME, Transformer
from shardrl.parallel.layout import Layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _model(config: ModelConfig, value_head: bool, dtype: torch.dtype) -> Transformer:
    return Transformer(config, Layout.single(), value_head=value_head, dtype=dtype)


def _config_dtype(config: ModelConfig) -> torch.dtype:
    """The dtype config.json declares (`dtype`, or `torch_dtype` before transformers 5); float32 if none."""
    name = config.hf_config.get("dtype") or config.hf_config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ModelConfigError(f"config.json dtype={name!r}: expected one of {', '.join(DTYPES)} (or pass --dtype)")
    return DTYPES[name]


def hf_to_dist(hf_dir: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write the HF checkpoint at `hf_dir` as a model-only distributed checkpoint at `out` (atomically)."""
    config = ModelConfig.from_pretrained(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    model = _model(config, VALUE_HEAD_NAME in reader, dtype or _config_dtype(config))
    load_hf_weights(model, reader)
    save_checkpoint(out, [model], Layout.single(), hf_dir=hf_dir, rng=False)


def dist_to_hf(dist_dir: str | Path, out: str | Path, config_path: str | Path | None = None,
               dtype: torch.dtype | None = None) -> None:
    """Write the model of the distributed checkpoint at `dist_dir` as an HF checkpoint at `out`. `config_path`:
    a config.json (or a directory holding one) for checkpoints stored without it; `dtype` converts the tensors."""
    dist_dir = Path(dist_dir)
    meta = dist_dir / META_FILE
    if meta.is_file() and json.loads(meta.read_text()).get("lora_adapters_only"):
        raise CheckpointError(f"{dist_dir}: holds LoRA adapters only (the base is the run's model.path); the run's "
                              f"hf_export/ has the merged model and hf_export/lora_adapter/ the PEFT adapter")
    config = ModelConfig.from_pretrained(config_path or dist_dir)
    tensors = saved_model_tensors(dist_dir)
    saved_dtypes = {saved for _, saved in tensors.values()}
    if len(saved_dtypes) != 1:
        raise CheckpointError(f"{dist_dir}: model tensors have dtypes {sorted(map(str, saved_dtypes))}; expected one")
    model = _model(config, VALUE_HEAD_NAME in tensors, saved_dtypes.pop())
    load_model_from_dist([model], Layout.single(), dist_dir)
    save_hf_checkpoint(model, Layout.single(), out, dtype=dtype)
    copy_hf_extra_files(dist_dir, Path(out))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shardrl.models.convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_dist = commands.add_parser("hf-to-dist", help="HF safetensors -> distributed checkpoint (model only)")
    to_dist.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    to_dist.add_argument("--out", required=True, help="distributed checkpoint directory to write")
    to_hf = commands.add_parser("dist-to-hf", help="distributed checkpoint -> HF safetensors + config.json")
    to_hf.add_argument("--dist", required=True, help="distributed checkpoint directory (converted or trained)")
    to_hf.add_argument("--out", required=True, help="HF model directory to write")
    to_hf.add_argument("--config", help="config.json to use when the checkpoint directory has none")
    for command in (to_dist, to_hf):
        command.add_argument("--dtype", choices=list(DTYPES), help="convert the weights to this dtype")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if args.command == "hf-to-dist":
            hf_to_dist(args.hf, args.out, dtype)
        else:
            dist_to_hf(args.dist, args.out, args.config, dtype)
    except (CheckpointError, ModelConfigError) as error:  # bad input: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
