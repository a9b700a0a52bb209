"""Batched scoring: decoding real token ids, scoring by data_source, and placing scores on the last valid token."""

from pathlib import Path

import pytest
import torch

from shardrl.data.batch import Batch
from shardrl.rewards.manager import compute_token_level_scores, place_on_last_token, score_responses
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
        {"responses": torch.tensor(rows), "response_mask": torch.tensor(masks)},
        {
            "data_source": ["openai/gsm8k"] * 3,
            "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
            "extra_info": [{}] * 3,
        },
    )
    token_scores, extras = compute_token_level_scores(batch, tokenizer, default_compute_score)  # [3, 16]
    expected = torch.zeros(3, width)
    for row, score in enumerate([1.0, 0.0, 1.0]):
        expected[row, sum(masks[row]) - 1] = score
    assert torch.equal(token_scores, expected) and extras == {}

    def with_extras(data_source, solution_str, ground_truth, extra_info):
        return {"score": float(solution_str.endswith(ground_truth)), "chars": len(solution_str)}

    scores, extras = score_responses(batch, tokenizer, with_extras)
    assert scores.tolist() == [1.0, 0.0, 0.0]  # "#### 1,000" does not end with "1000"
    assert extras == {"chars": [len(t) for t in texts]}  # special tokens are not part of the decoded text
