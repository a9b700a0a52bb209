"""The default job's task: everything it needs (tokenizer, model, data, reward) made locally, offline, in seconds.

Task "digit successor": the prompt is a short list of digits, the answer is the successor (mod 10) of the LAST one,
then EOS: ``"3 8 1 ->"`` -> ``"2<eos>"``, so a model generating from the export stops after its answer. A random
policy scores about 0.05 (the right digit about once in `len(VOCAB)` tries, half credit without the EOS), so a
rising reward means the policy learned it from reward alone. It is learnable by a 2-layer model in a few hundred
samples: the answer is a fixed function of the last prompt token, which sits in the residual stream of the
generating position.
Successor rather than "repeat the last digit" because a randomly initialised model with tied embeddings already
tends to repeat its input token, which would make the untrained policy look good.

The tokenizer is character level (one token per digit/symbol) and the whole job goes through the real text path:
chat template, parquet dataset, detokenisation and a registered rule-based scorer (`shardrl.rewards.digits`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# A run directory made by an earlier version of the task is made again (2: the answer ends with EOS, pads are EOS;
# 3: no unknown token added on loading)
TASK_VERSION = 3
DATA_SOURCE = "shardrl/digit_successor"  # scored by shardrl.rewards.digits
LOOKUP_SOURCE = "shardrl/digit_lookup"  # the multi-turn variant, scored by shardrl.rewards.digits too


SPECIAL = ["<pad>", "<eos>"]  # "<pad>" is an ordinary token (the unknown one): padding is EOS, see make_tokenizer
CHARS = list("0123456789->")  # spaces in the text are separators only: the pre-tokenizer drops them
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


# Multi-turn variant, "digit lookup": the answer is a secret digit only a tool knows. The model calls the tool with
# one token, the whole Hermes call (an added token, not special, so it decodes to the text the real parser reads);
# that token also ends its turn (an EOS of the model). The tool's answer comes back in the template's tool turn and
# the model must copy it. Without the call a guess is right 1 time in 10.
CALL = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
TOOL_TOKENS = [CALL, "<tool_response>", "</tool_response>"]
TOOL_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}<eos>{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
LOOKUP_TOOL_CONFIG = f"""tools:
  - class_name: shardrl.agents.lookup_tool.LookupTool
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: lookup
        description: The secret digit of this sample.
        parameters:
          type: object
          properties: {{}}
          required: []
"""


def make_tokenizer(out_dir: str | Path, multi_turn: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a trivial chat template (the prompt text itself), saved to `out_dir`;
    `multi_turn` adds the tool tokens and a template with assistant and tool turns.

    EOS is the only special token (pads with it, as Llama's and Qwen's base tokenizers do): a response is decoded for
    scoring without special tokens, so were "<pad>" special, a sampled "<pad>" after the answer would read as the
    EOS the scorer asks for."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split("", behavior="isolated")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<eos>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    if multi_turn:
        tokenizer.add_tokens(TOOL_TOKENS)
        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    # transformers 5 loads this directory (the model's type is qwen2) as a Qwen2Tokenizer, whose default unknown
    # token "<|endoftext|>" it would add as one more id, past the model's vocabulary; a null unknown token keeps the
    # vocabulary as built (the WordLevel model maps unknown text to "<pad>" itself).
    settings = Path(out_dir) / "tokenizer_config.json"
    settings.write_text(json.dumps(json.loads(settings.read_text()) | {"unk_token": None}, indent=2))
    return tokenizer


def make_rows(num_rows: int, seed: int, multi_turn: bool = False) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        digits = [rng.randrange(10) for _ in range(rng.randint(2, 5))]
        if multi_turn:
            secret = str(rng.randrange(10))
            rows.append({
                "data_source": LOOKUP_SOURCE, "agent_name": "tool_agent",
                "prompt": [{"role": "user", "content": " ".join(map(str, digits)) + " ->"}],
                "ability": "tools", "reward_model": {"style": "rule", "ground_truth": secret},
                "extra_info": {"index": i, "tools_kwargs": {"lookup": {"create_kwargs": {"value": secret}}}},
            })
            continue
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": " ".join(map(str, digits)) + " ->"}],
            "ability": "digits",
            "reward_model": {"style": "rule", "ground_truth": str((digits[-1] + 1) % 10)},
            "extra_info": {"index": i},
        })
    return rows


def write_dataset(path: str | Path, num_rows: int, seed: int, multi_turn: bool = False) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(make_rows(num_rows, seed, multi_turn)), path)
    return path


def model_config(multi_turn: bool = False) -> dict[str, Any]:
    """The built-in model's config.json fields that `make_model` sets: a 2-layer Qwen2 shape (~100k parameters) over
    the tokenizer's vocabulary (`make_tokenizer`'s ids: the specials, the characters, then the tool tokens), whose
    EOS ids are "<eos>" and, multi-turn, the tool call that ends a turn. The dry run checks a layout and
    `model.override_config` against it before the model exists."""
    tokens = SPECIAL + CHARS + (TOOL_TOKENS if multi_turn else [])
    eos = [tokens.index("<eos>")] + ([tokens.index(CALL)] if multi_turn else [])
    return dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=len(tokens), hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
                eos_token_id=eos[0] if len(eos) == 1 else eos, pad_token_id=0)


def make_model(out_dir: str | Path, multi_turn: bool = False, seed: int = 0) -> Path:
    """The built-in model (`model_config`), randomly initialised and saved by HF transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    fields = model_config(multi_turn)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar, for one file of 300 kB
    try:
        model.save_pretrained(out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return Path(out_dir)


def prepare(root: str | Path, seed: int = 0, train_rows: int = 4096, val_rows: int = 256,
            multi_turn: bool = False) -> dict[str, str]:
    """Create tokenizer + model + train/val parquet under `root` (idempotent for one `TASK_VERSION`); return their
    paths. `multi_turn`: the digit-lookup variant, with its tool config (`tool_config`)."""
    root = Path(root)
    marker = root / "builtin_task.json"
    if marker.exists() and json.loads(marker.read_text()).get("version") == TASK_VERSION:
        return json.loads(marker.read_text())
    make_tokenizer(root / "model", multi_turn)
    make_model(root / "model", multi_turn, seed)
    paths = {
        "version": TASK_VERSION,
        "model": str(root / "model"),
        "train_files": str(write_dataset(root / "train.parquet", train_rows, seed, multi_turn)),
        "val_files": str(write_dataset(root / "val.parquet", val_rows, seed + 1, multi_turn)),
    }
    if multi_turn:
        (root / "tool_config.yaml").write_text(LOOKUP_TOOL_CONFIG)
        paths["tool_config"] = str(root / "tool_config.yaml")
    marker.write_text(json.dumps(paths))
    return paths
