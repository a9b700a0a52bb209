"""`data.apply_chat_template_kwargs` reach the chat template: with the real Qwen3 tokenizer, enable_thinking=False
renders the empty think block that the default prompt lacks."""

import json
from pathlib import Path

import pytest

from shardrl.data.chat import prompt_token_ids
from shardrl.data.rl_dataset import RLDataset

TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "qwen3"
pytestmark = pytest.mark.skipif(not TOKENIZER.is_dir(), reason=f"needs the shared Qwen3 tokenizer at {TOKENIZER}")

MESSAGES = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "Name a prime."}]]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def test_enable_thinking_false_changes_the_prompt_ids(tokenizer, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": m, "data_source": "x", "reward_model": {"ground_truth": "5"}})
                            + "\n" for m in MESSAGES))
    default = RLDataset(path, tokenizer).prompt_ids
    no_thinking = RLDataset(path, tokenizer, chat_template_kwargs={"enable_thinking": False}).prompt_ids
    # Independent reference: transformers renders and tokenizes each conversation itself.
    reference = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                               enable_thinking=False)["input_ids"] for m in MESSAGES]
    assert no_thinking == reference
    assert default == [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"]
                       for m in MESSAGES]
    think_block = tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    for plain, rendered in zip(default, no_thinking):
        assert rendered == plain + think_block


def test_arguments_shardrl_sets_itself_are_refused(tokenizer):
    with pytest.raises(ValueError, match="^data.apply_chat_template_kwargs.add_generation_prompt: set by shardrl"):
        prompt_token_ids(tokenizer, MESSAGES, {"add_generation_prompt": False})


def test_render_workers_render_shares_of_the_rows_in_processes_with_the_same_ids(tokenizer, tmp_path, monkeypatch):
    """verl's `data.filter_overlong_prompts_workers`: the template runs in that many processes, each on a contiguous
    share, and the ids (kwargs included) are transformers' own in row order."""
    import shardrl.data.chat as chat

    pools = []

    class CountingPool(chat.ProcessPoolExecutor):
        def __init__(self, max_workers, **kwargs):
            pools.append(max_workers)
            super().__init__(max_workers, **kwargs)

    monkeypatch.setattr(chat, "ProcessPoolExecutor", CountingPool)
    rows = [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(7)]
    ids = prompt_token_ids(tokenizer, rows, {"enable_thinking": False}, workers=3)
    assert pools == [3]
    assert ids == [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                 enable_thinking=False)["input_ids"] for m in rows]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": m, "data_source": "x", "reward_model": {"ground_truth": "5"}})
                            + "\n" for m in rows))
    assert RLDataset(path, tokenizer, render_workers=2).prompt_ids == RLDataset(path, tokenizer).prompt_ids
    assert pools == [3, 2]


def test_a_template_failing_in_a_render_worker_is_the_datasets_one_line_error(tokenizer, tmp_path):
    from shardrl.data.rl_dataset import DatasetError

    path = tmp_path / "rows.jsonl"
    rows = [[{"role": "user", "content": "hi"}]] * 3 + [[{"role": "user", "content": [{"type": "image"}]}]]
    path.write_text("".join(json.dumps({"prompt": m, "data_source": "x", "reward_model": {"ground_truth": "5"}})
                            + "\n" for m in rows))
    with pytest.raises(DatasetError) as single:
        RLDataset(path, tokenizer)
    with pytest.raises(DatasetError) as err:  # the failing row is in the second worker's share
        RLDataset(path, tokenizer, render_workers=2)
    assert str(err.value) == str(single.value) and "chat template failed" in str(err.value)
    assert "\n" not in str(err.value)
