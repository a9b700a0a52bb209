"""`data.reward_fn_key`: the column that picks each sample's reward function, carried by the dataset under its own
name and read by the reward manager; a batch without it fails naming the key."""

import json
from pathlib import Path

import pytest
import torch

from shardrl.data.batch import Batch
from shardrl.data.rl_dataset import RLDataset
from shardrl.rewards.manager import compute_token_level_scores, score_responses

TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "qwen3"


class SpacedDigits:
    """Decodes ids as their digits: all the manager needs of a tokenizer."""

    def batch_decode(self, rows: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return [" ".join(map(str, ids)) for ids in rows]


def _scored_by_source(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> dict:
    return {"score": float(data_source == "math" and solution_str == ground_truth), "source": data_source}


def _batch(non_tensors: dict) -> Batch:
    responses = torch.tensor([[1, 2, 0], [1, 2, 0], [3, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    return Batch({"responses": responses, "response_mask": mask, "attention_mask": mask}, non_tensors)


REWARD_FIELDS = {"reward_model": [{"ground_truth": "1 2"}, {"ground_truth": "1 2"}, {"ground_truth": "3"}],
                 "extra_info": [{}, {}, {}]}


def test_the_key_names_the_column_that_picks_the_reward_function():
    # `data_source` says one thing, `task` another: the key decides which the reward function sees.
    batch = _batch({"data_source": ["other"] * 3, "task": ["math", "code", "math"], **REWARD_FIELDS})
    scored = compute_token_level_scores(batch, SpacedDigits(), _scored_by_source, data_source_key="task")
    assert scored.scores.tolist() == [1.0, 0.0, 1.0]
    assert scored.extras["source"] == ["math", "code", "math"]
    assert scored.token_level.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    default = compute_token_level_scores(batch, SpacedDigits(), _scored_by_source)
    assert default.extras["source"] == ["other"] * 3 and default.scores.tolist() == [0.0] * 3


def test_a_missing_column_is_named():
    batch = _batch({"data_source": ["math"] * 3, **REWARD_FIELDS})
    with pytest.raises(ValueError, match=r"^data.reward_fn_key='task': the batch has no such column; it has "
                                         r"\['data_source', 'extra_info', 'reward_model'\]$"):
        score_responses(batch, SpacedDigits(), _scored_by_source, data_source_key="task")


@pytest.mark.skipif(not TOKENIZER.is_dir(), reason=f"needs the shared Qwen3 tokenizer at {TOKENIZER}")
def test_the_dataset_requires_and_carries_the_column(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "task": "math",
             "reward_model": {"ground_truth": str(i + 1)}} for i in range(3)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    batch = RLDataset(path, tokenizer, data_source_key="task").collate([0, 2])
    assert list(batch.non_tensors["task"]) == ["math", "math"]
    assert list(batch.non_tensors["data_source"]) == [None, None]  # the file has none
    with pytest.raises(ValueError, match="row 0 is missing column 'data_source'"):
        RLDataset(path, tokenizer)
