"""Batched scoring: decoding real token ids, scoring by data_source, and placing scores on the last valid token."""

from pathlib import Path

import pytest
import torch

from shardrl.data.batch import Batch
from shardrl.data import builtin_task
from shardrl.rewards.manager import (OverlongShaping, compute_token_level_scores, overlong_penalty,
                                     place_on_last_token, score_responses)
from shardrl.rewards.registry import default_compute_score

TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "qwen3"


def test_place_on_last_token_hand_written():
    mask = torch.tensor([
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 1, 1, 0],  # a hole (masked tool output): the score still goes on the last generated token
    ])
    out = place_on_last_token(torch.tensor([0.5, -1.0, 2.0]), mask)
    assert out.tolist() == [
        [0.0, 0.0, 0.5, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, -1.0],
        [0.0, 0.0, 0.0, 2.0, 0.0],
    ]


def test_place_on_last_token_refuses_empty_rows():
    with pytest.raises(ValueError, match=r"rows \[1\] have an all-zero response_mask"):
        place_on_last_token(torch.ones(2), torch.tensor([[1, 0], [0, 0]]))


@pytest.mark.skipif(not TOKENIZER.is_dir(), reason=f"needs the shared Qwen3 tokenizer at {TOKENIZER}")
def test_scores_decoded_responses_on_last_token():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    texts = ["24 + 48 = 72\n#### 72", "The answer is 5.\n#### 6", "#### 1,000"]
    truths = ["72", "5", "1000"]
    width = 16
    rows, masks = [], []
    for text in texts:
        # Response as the rollout returns it: generated ids, EOS, then right padding.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        rows.append(ids + [tokenizer.pad_token_id] * (width - len(ids)))
        masks.append([1] * len(ids) + [0] * (width - len(ids)))
    batch = Batch(
        {"responses": torch.tensor(rows), "response_mask": torch.tensor(masks), "attention_mask": torch.tensor(masks)},
        {
            "data_source": ["openai/gsm8k"] * 3,
            "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
            "extra_info": [{}] * 3,
        },
    )
    scored = compute_token_level_scores(batch, tokenizer, default_compute_score)
    expected = torch.zeros(3, width)
    for row, score in enumerate([1.0, 0.0, 1.0]):
        expected[row, sum(masks[row]) - 1] = score
    assert torch.equal(scored.token_level, expected) and scored.extras == {}  # [3, 16]
    assert scored.scores.tolist() == [1.0, 0.0, 1.0]

    def with_extras(data_source, solution_str, ground_truth, extra_info):
        return {"score": float(solution_str.endswith(ground_truth)), "chars": len(solution_str)}

    scores, extras = score_responses(batch, tokenizer, with_extras)
    assert scores.tolist() == [1.0, 0.0, 0.0]  # "#### 1,000" does not end with "1000"
    assert extras == {"chars": [len(t) for t in texts]}  # special tokens are not part of the decoded text


def test_overlong_penalty_hand_computed():
    # L = 10 tokens, buffer B = 4: free up to 6 tokens, then (6 - n) / 4 * factor, reaching -factor at n = 10.
    lengths = torch.tensor([1, 5, 6, 7, 8, 9, 10])
    assert overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    # The buffer may be the whole response: every generated token costs 1/L of the factor.
    assert overlong_penalty(torch.tensor([0, 2, 4]), 4, 4, 2.0).tolist() == [0.0, -1.0, -2.0]


def test_overlong_shaping_reaches_the_last_token_score_and_logs(tmp_path):
    """Three correct answers of 1, 2 and 4 generated tokens (digit, then EOS or more digits: half credit) against
    L = 4, B = 2: penalties 0, 0, -1.5 (factor 1.5), added to the score on each response's last token."""
    tokenizer = builtin_task.make_tokenizer(tmp_path)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("3", "<eos>", "<pad>", "1")]
    three, eos, pad, one = ids
    responses = torch.tensor([[three, pad, pad, pad], [three, eos, pad, pad], [three, one, one, one]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    batch = Batch({"responses": responses, "response_mask": mask, "attention_mask": mask},
                  {"data_source": [builtin_task.DATA_SOURCE] * 3,
                   "reward_model": [{"ground_truth": "3"}] * 3, "extra_info": [{}] * 3})
    scored = compute_token_level_scores(batch, tokenizer, default_compute_score, OverlongShaping(4, 2, 1.5, log=True))
    assert scored.scores.tolist() == [1.0, 1.0, 0.5]  # the reward function's own scores, unshaped
    assert scored.token_level.tolist() == [[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 0, -1.0]]
    assert scored.extras == {"overlong_reward": [0.0, 0.0, -1.5], "overlong": [False, False, True]}
    quiet = compute_token_level_scores(batch, tokenizer, default_compute_score, OverlongShaping(4, 2, 1.5, log=False))
    assert torch.equal(quiet.token_level, scored.token_level) and quiet.extras == {}
