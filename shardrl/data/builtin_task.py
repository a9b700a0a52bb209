"""The default job's task: everything it needs (tokenizer, model, data, reward) made locally, offline, in seconds.

Task "digit successor": the prompt is a short list of digits, the answer is the successor (mod 10) of the LAST one:
``"3 8 1 ->"`` -> ``"2"``. A random policy is right about once in `len(VOCAB)` tries (~0.05), so a rising reward
means the policy learned it from reward alone. It is learnable by a 2-layer model in a few hundred samples: the
answer is a fixed function of the last prompt token, which sits in the residual stream of the generating position.
Successor rather than "repeat the last digit" because a randomly initialised model with tied embeddings already
tends to repeat its input token, which would make the untrained policy look good.

The tokenizer is character level (one token per digit/symbol) and the whole job goes through the real text path:
chat template, parquet dataset, detokenisation and a registered rule-based scorer (`shardrl.rewards.digits`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

DATA_SOURCE = "shardrl/digit_successor"  # scored by shardrl.rewards.digits


SPECIAL = ["<pad>", "<eos>"]
CHARS = list("0123456789->")  # spaces in the text are separators only: the pre-tokenizer drops them
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def make_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a trivial chat template (the prompt text itself), saved to `out_dir`."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split("", behavior="isolated")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def make_rows(num_rows: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        digits = [rng.randrange(10) for _ in range(rng.randint(2, 5))]
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": " ".join(map(str, digits)) + " ->"}],
            "ability": "digits",
            "reward_model": {"style": "rule", "ground_truth": str((digits[-1] + 1) % 10)},
            "extra_info": {"index": i},
        })
    return rows


def write_dataset(path: str | Path, num_rows: int, seed: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(make_rows(num_rows, seed)), path)
    return path


def make_model(out_dir: str | Path, vocab_size: int, seed: int = 0) -> Path:
    """A randomly initialised 2-layer Qwen2-shaped model (~100k parameters), saved by HF transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=SPECIAL.index("<eos>"), pad_token_id=0, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    return Path(out_dir)


def prepare(root: str | Path, seed: int = 0, train_rows: int = 4096, val_rows: int = 256) -> dict[str, str]:
    """Create tokenizer + model + train/val parquet under `root` (idempotent); return their paths."""
    root = Path(root)
    marker = root / "builtin_task.json"
    if marker.exists():
        return json.loads(marker.read_text())
    tokenizer = make_tokenizer(root / "model")
    make_model(root / "model", len(tokenizer), seed)
    paths = {
        "model": str(root / "model"),
        "train_files": str(write_dataset(root / "train.parquet", train_rows, seed)),
        "val_files": str(write_dataset(root / "val.parquet", val_rows, seed + 1)),
    }
    marker.write_text(json.dumps(paths))
    return paths
