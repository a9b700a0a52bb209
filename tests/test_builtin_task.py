"""The default job's task: text path round trip, scorer, and that an untrained policy scores far below 0.3."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardrl.data.builtin_task import CALL, model_config, prepare
from shardrl.data.rl_dataset import RLDataset
from shardrl.data.builtin_task import DATA_SOURCE
from shardrl.rewards.registry import default_compute_score


def test_prepare_dataset_and_scorer(tmp_path):
    paths = prepare(tmp_path, train_rows=64, val_rows=8)
    assert prepare(tmp_path) == paths  # idempotent: a second call reuses the files
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    assert tokenizer("7 0 9 ->")["input_ids"] == tokenizer.convert_tokens_to_ids(list("709->"))
    dataset = RLDataset([paths["train_files"]], tokenizer, max_prompt_length=12)
    batch = dataset.collate(list(range(4)))
    for row, truth in zip(batch.non_tensors["raw_prompt"], batch.non_tensors["reward_model"]):
        last_digit = int(row[0]["content"].split()[-2])
        assert truth["ground_truth"] == str((last_digit + 1) % 10)

    def score(tokens: list[str]) -> float:  # as the reward manager scores: decoded without special tokens
        ids = tokenizer.convert_tokens_to_ids(tokens)
        return default_compute_score(DATA_SOURCE, tokenizer.decode(ids, skip_special_tokens=True), "3")

    assert score(["3", "<eos>"]) == 1.0  # the answer, then EOS
    assert score(["3", "3"]) == score(["3", "<pad>"]) == 0.5  # the answer without EOS ("<pad>" is not special)
    assert score(["4", "<eos>"]) == score(["<eos>"]) == 0.0
    assert tokenizer.pad_token_id == tokenizer.eos_token_id and tokenizer.convert_tokens_to_ids("<pad>") not in \
        tokenizer.all_special_ids


def test_untrained_policy_scores_well_below_threshold(tmp_path):
    paths = prepare(tmp_path, train_rows=256, val_rows=8)
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"])
    dataset = RLDataset([paths["train_files"]], tokenizer, max_prompt_length=12)
    batch = dataset.collate(list(range(256)))
    torch.manual_seed(0)
    out = model.generate(input_ids=batch.tensors["input_ids"], attention_mask=batch.tensors["attention_mask"],
                         do_sample=True, max_new_tokens=2, pad_token_id=0)
    texts = tokenizer.batch_decode(out[:, 12:], skip_special_tokens=True)
    truths = [r["ground_truth"] for r in batch.non_tensors["reward_model"]]
    accuracy = sum(default_compute_score(DATA_SOURCE, t, g) for t, g in zip(texts, truths)) / len(texts)
    assert accuracy < 0.2, accuracy


@pytest.mark.parametrize("multi_turn", [False, True])
def test_model_config_is_what_the_task_saves(tmp_path, multi_turn):
    """The dry run checks the built-in model by `model_config`: it must be the saved config.json and match the
    saved tokenizer (vocabulary size, EOS ids)."""
    paths = prepare(tmp_path / "task", train_rows=8, val_rows=8, multi_turn=multi_turn)
    expected = model_config(multi_turn)
    saved = json.loads((Path(paths["model"]) / "config.json").read_text())
    assert {field: saved.get(field) for field in expected} == expected
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])  # as the trainer and an export's user load it
    assert len(tokenizer) == expected["vocab_size"]
    eos = [tokenizer.eos_token_id] + ([tokenizer.convert_tokens_to_ids(CALL)] if multi_turn else [])
    assert expected["eos_token_id"] == (eos[0] if len(eos) == 1 else eos)
