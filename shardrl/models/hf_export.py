"""A trained model as a self-contained HF model directory: what `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained`
and `generate` need, with nothing else to find. The workers write the weights and config.json (`save_hf_checkpoint`,
with the source model's generation defaults); `complete_export` adds the run's tokenizer (and so its chat template)
and the generation ids, and makes every file readable (safetensors writes its files 0600). The whole directory is
built under a temporary name and renamed into place (`commit_directory`): a crash leaves the previous export or
none, never half of one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from shardrl.data.chat import pad_id
from shardrl.models.checkpoint import commit_directory

GENERATION_CONFIG = "generation_config.json"


def export_dir(out_dir: Path, write_weights: Callable[[Path], None], tokenizer: PreTrainedTokenizerBase) -> None:
    """Build `out_dir`: `write_weights(tmp)` writes the model into a temporary sibling directory, which is completed
    (`complete_export`) and then renamed to `out_dir` (replacing an earlier export)."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if tmp.exists():  # left by a crash inside an earlier export
        shutil.rmtree(tmp)
    write_weights(tmp)
    complete_export(tmp, tokenizer)
    commit_directory(tmp, out_dir)


def complete_export(directory: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Add the tokenizer files (with its chat template) and a generation config: eos / bos ids the model's (the
    source model's generation config, which the workers copied, else config.json) or else the tokenizer's, and the
    tokenizer's pad id (generate pads finished rows with it, which decoding then skips); files 0644, dirs 0755."""
    tokenizer.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    path = directory / GENERATION_CONFIG
    generation = json.loads(path.read_text()) if path.exists() else {}
    for key, fallback in (("eos_token_id", tokenizer.eos_token_id), ("bos_token_id", tokenizer.bos_token_id)):
        value = next((v for v in (generation.get(key), config.get(key), fallback) if v is not None), None)
        if value is not None:
            generation[key] = value
    if pad_id(tokenizer) is not None:
        generation["pad_token_id"] = pad_id(tokenizer)
    path.write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    directory.chmod(0o755)
    for item in directory.rglob("*"):
        item.chmod(0o755 if item.is_dir() else 0o644)
