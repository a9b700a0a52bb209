"""`trainer.log_val_generations`: at each validation, N (input, output, score) samples go to the loggers. Which ones
is a fixed-seed choice by input text; the file logger appends them with the step to `val_generations.jsonl`, the
console prints a table; the trainer's validation logs them with scores its own scorer agrees with."""

import json

import pytest
import torch
from trainer_in_gloo import colocated_trainer

from shardrl.data import builtin_task
from shardrl.data.batch import Batch
from shardrl.data.rl_dataset import RLDataset
from shardrl.parallel.launch import run_distributed
from shardrl.rewards import digits
from shardrl.rewards.registry import default_compute_score
from shardrl.trainer import batch_ops
from shardrl.trainer.tracking import Tracker

PROMPTS = ["3 8 1 ->", "2 2 ->", "7 0 4 5 ->", "9 9 ->", "5 6 7 ->"]
RESPONSES = ["2", "3", "6", "1", "0"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return builtin_task.prepare(tmp_path_factory.mktemp("task"), train_rows=64, val_rows=16)


def generated(tokenizer, order: list[int]) -> Batch:
    """What generation returns for PROMPTS[order] (left-padded prompts, right-padded responses) and their scores."""
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i]}])["input_ids"] for i in order]
    width = max(map(len, prompt_ids))
    prompts = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompt_ids])  # [B, P]
    responses = torch.tensor([tokenizer.encode(RESPONSES[i]) + [tokenizer.pad_token_id] for i in order])  # [B, 2]
    response_mask = torch.tensor([[1, 0]] * len(order))
    attention_mask = torch.cat([(prompts != tokenizer.pad_token_id).long(), response_mask], 1)
    return Batch({"prompts": prompts, "responses": responses, "response_mask": response_mask,
                  "attention_mask": attention_mask})


def test_choice_is_fixed_by_the_inputs_and_decodes_each_sample(paths):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    scores = torch.arange(5.0).numpy()  # sample i scores i
    rows = batch_ops.val_generations(generated(tokenizer, [0, 1, 2, 3, 4]), tokenizer, scores, 3)
    assert len(rows) == 3
    # Spaces are separators only for the character-level tokenizer: compare without them.
    texts = {p.replace(" ", ""): (r, float(i)) for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))}
    for row in rows:
        assert (row["output"], row["score"]) == texts[row["input"].replace(" ", "")]
    # The same samples, in the same order, when generation returned the rows in another order.
    reordered = [4, 2, 0, 3, 1]
    again = batch_ops.val_generations(generated(tokenizer, reordered), tokenizer, scores[reordered], 3)
    assert again == rows
    # First N of one shuffle: asking for more extends the list; for more than there are, all of them.
    everything = batch_ops.val_generations(generated(tokenizer, [0, 1, 2, 3, 4]), tokenizer, scores, 10)
    assert everything[:3] == rows and len(everything) == 5
    assert [r["input"].replace(" ", "") for r in everything] != sorted(texts)  # shuffled, not the sorted inputs


def test_tracker_writes_generations_with_the_step_and_prints_a_table(tmp_path, capsys):
    tracker = Tracker(["console", "file"], tmp_path, "p", "e", {})
    tracker.log_generations(3, [{"input": "1 2 - >", "output": "3", "score": 1.0}])
    tracker.log_generations(6, [{"input": "4 - >", "output": "0", "score": 0.0},
                                {"input": "x" * 200, "output": "9", "score": 0.5}])
    tracker.close()
    lines = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert lines == [{"step": 3, "input": "1 2 - >", "output": "3", "score": 1.0},
                     {"step": 6, "input": "4 - >", "output": "0", "score": 0.0},
                     {"step": 6, "input": "x" * 200, "output": "9", "score": 0.5}]
    out = " ".join(capsys.readouterr().out.split())  # rich wraps the title to the table's width
    assert "validation generations, step 3" in out and "1 2 - >" in out
    assert 0 < out.count("x") <= 80  # long inputs are cut


def validate_twice(model_path: str, val_files: str, run_dir: str) -> list[dict]:
    tracker = Tracker(["file"], run_dir, "p", "e", {})
    overrides = ["trainer.device=cpu", "trainer.log_val_generations=3", "actor_rollout_ref.rollout.val_kwargs.n=2"]
    trainer, _, tokenizer = colocated_trainer(model_path, overrides, default_compute_score, tracker)
    trainer.val_prompts = RLDataset(val_files, tokenizer).collate(list(range(8)))
    metrics = [trainer.validate()]
    trainer.global_step = 5
    metrics.append(trainer.validate())
    tracker.close()
    return metrics


def test_validation_logs_n_scored_generations_at_each_validation(paths, tmp_path):
    (metrics,) = run_distributed(1, validate_twice, paths["model"], paths["val_files"], tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 0, 5, 5, 5]
    assert [r["input"] for r in rows[:3]] == [r["input"] for r in rows[3:]]  # the same prompts each time
    for row in rows:  # the input is the question; the task: its answer is the successor of its last digit
        assert row["input"].endswith(" ->"), row
        last_digit = int(row["input"].split()[-2])
        assert row["score"] == digits.compute_score(row["output"], str((last_digit + 1) % 10)), row
    assert all(0.0 <= m["val-core/reward/mean"] <= 1.0 for m in metrics)
