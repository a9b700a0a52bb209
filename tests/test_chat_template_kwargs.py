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
