"""RL dataset and loader on real GSM8K rows with the real Qwen3 tokenizer.

The rows come from running the example preprocess script on the first lines of the shared GSM8K train split.
"""

import importlib.util
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardrl.data.rl_dataset import DatasetError, PromptLoader, RLDataset

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
GSM8K_TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"
TOKENIZER = SHARED_DATA / "tokenizers" / "qwen3"
NUM_ROWS = 12

pytestmark = pytest.mark.skipif(
    not (GSM8K_TRAIN.is_file() and TOKENIZER.is_dir()),
    reason=f"needs the shared GSM8K split and Qwen3 tokenizer under {SHARED_DATA}",
)


def load_preprocess():
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess", REPO / "examples/data_preprocess/gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def gsm8k_parquet(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gsm8k") / "train.parquet"
    assert load_preprocess().convert(GSM8K_TRAIN, out, "train", limit=NUM_ROWS) == NUM_ROWS
    return out


@pytest.fixture(scope="module")
def reference_ids(tokenizer, gsm8k_parquet) -> list[list[int]]:
    """Independent reference: the chat template applied and tokenized by transformers itself, per row."""
    rows = pq.read_table(gsm8k_parquet).to_pylist()
    return [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]
            for r in rows]


def test_preprocess_rows():
    module = load_preprocess()
    first = json.loads(GSM8K_TRAIN.open().readline())
    row = module.make_row(first, 0, "train")
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": first["question"] + ' Let\'s think step by step and output '
                              'the final answer after "####".'}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert module.extract_answer("so 1,000 + 80 = 1,080\n#### 1,080") == "1080"


def test_left_padding_masks_and_positions(tokenizer, gsm8k_parquet, reference_ids):
    max_len = max(map(len, reference_ids)) + 5
    dataset = RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=max_len)
    assert len(dataset) == NUM_ROWS and dataset.num_filtered == 0
    batch = dataset.collate([0, 3])
    ids, mask, pos = (batch.tensors[k] for k in ("input_ids", "attention_mask", "position_ids"))  # [2, max_len]
    assert ids.shape == mask.shape == pos.shape == (2, max_len)
    for row, i in enumerate([0, 3]):
        n = len(reference_ids[i])
        assert ids[row, max_len - n:].tolist() == reference_ids[i]
        assert ids[row, :max_len - n].tolist() == [tokenizer.pad_token_id] * (max_len - n)
        assert mask[row].tolist() == [0] * (max_len - n) + [1] * n
        assert pos[row].tolist() == [0] * (max_len - n) + list(range(n))
        assert batch.non_tensors["raw_prompt_ids"][row] == reference_ids[i]
    text = tokenizer.decode(ids[0, mask[0].bool()])
    assert text.startswith("<|im_start|>user\nNatalia") and text.endswith("<|im_start|>assistant\n")
    assert list(batch.non_tensors["data_source"]) == ["openai/gsm8k"] * 2
    assert batch.non_tensors["reward_model"][0]["ground_truth"] == "72"
    assert batch.non_tensors["extra_info"][1]["index"] == 3


def test_filter_overlong_counts_and_logs(tokenizer, gsm8k_parquet, reference_ids, caplog):
    limit = sorted(map(len, reference_ids))[NUM_ROWS // 2]
    expected_kept = sum(len(r) <= limit for r in reference_ids)
    with caplog.at_level(logging.INFO, logger="shardrl.data.rl_dataset"):
        dataset = RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=limit, filter_overlong_prompts=True)
    assert len(dataset) == expected_kept and dataset.num_filtered == NUM_ROWS - expected_kept > 0
    assert f"filtered {NUM_ROWS - expected_kept} prompts" in caplog.text
    assert dataset.prompt_ids == [r for r in reference_ids if len(r) <= limit]



def test_max_samples_keeps_the_first_rows_that_fit(tokenizer, gsm8k_parquet, reference_ids):
    limit = sorted(map(len, reference_ids))[NUM_ROWS // 2]
    fitting = [r for r in reference_ids if len(r) <= limit]
    dataset = RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=limit, filter_overlong_prompts=True,
                        max_samples=3)
    assert dataset.prompt_ids == fitting[:3] and len(dataset.rows) == 3
    assert len(RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=256, max_samples=-1)) == NUM_ROWS

def test_truncation_left_and_right(tokenizer, gsm8k_parquet, reference_ids):
    limit = min(map(len, reference_ids)) - 3  # every row is too long
    left = RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=limit, truncation="left")
    right = RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=limit, truncation="right")
    assert left.prompt_ids == [r[-limit:] for r in reference_ids]
    assert right.prompt_ids == [r[:limit] for r in reference_ids]
    batch = left.collate(range(NUM_ROWS))
    assert batch.tensors["attention_mask"].all() and batch.tensors["position_ids"][0].tolist() == list(range(limit))
    assert tokenizer.decode(batch.tensors["input_ids"][0]).endswith("<|im_start|>assistant\n")


def test_truncation_error_names_row_length_and_key(tokenizer, gsm8k_parquet, reference_ids):
    limit = len(reference_ids[0]) - 1
    first_too_long = next(i for i, r in enumerate(reference_ids) if len(r) > limit)
    with pytest.raises(ValueError, match=rf"train.parquet row {first_too_long}: prompt has "
                                         rf"{len(reference_ids[first_too_long])} tokens > data.max_prompt_length="
                                         rf"{limit}; set data.truncation"):
        RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=limit, truncation="error")


def test_bad_truncation_value(tokenizer, gsm8k_parquet):
    with pytest.raises(ValueError, match=r"data.truncation must be one of \['error', 'left', 'right'\], got 'middle'"):
        RLDataset(gsm8k_parquet, tokenizer, truncation="middle")


def test_file_errors(tokenizer, gsm8k_parquet, tmp_path):
    with pytest.raises(DatasetError, match="nope.parquet: RL data file not found"):
        RLDataset(tmp_path / "nope.parquet", tokenizer)
    rows = pq.read_table(gsm8k_parquet).to_pylist()
    no_reward = tmp_path / "no_reward.parquet"
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "reward_model"} for r in rows]), no_reward)
    with pytest.raises(ValueError, match="no_reward.parquet: missing column 'reward_model'"):
        RLDataset(no_reward, tokenizer)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(gsm8k_parquet).slice(0, 0), empty)
    with pytest.raises(ValueError, match="empty.parquet: the RL data file has no rows"):
        RLDataset(empty, tokenizer)
    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: the RL data file has no rows"):
        RLDataset(empty_jsonl, tokenizer)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"data_source": "x", "reward_model": {}}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl: row 1 is missing column 'prompt'"):
        RLDataset(bad_jsonl, tokenizer)
    cases = {  # a file's bytes or rows -> the one-line error naming it
        "zero.parquet": (b"", r"zero.parquet: not a readable parquet file \(.*\); write it again"),
        "junk.parquet": (b"PAR1 not really", r"junk.parquet: not a readable parquet file"),
        "junk.jsonl": (b'{"a": 1}\n{oops\n', r"junk.jsonl line 2: not JSON"),
        "list.jsonl": (b"[1, 2]\n", r"list.jsonl line 1: a JSON list, not an object"),
        "prompt.parquet": ([{**rows[0], "prompt": "just text"}], r"prompt.parquet row 0: 'prompt' must be a list"),
        "role.parquet": ([{**rows[0], "prompt": [{"content": "hi"}]}],
                         r"role.parquet row 0: 'prompt' must be a non-empty list of messages with a 'role'"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            pq.write_table(pa.Table.from_pylist(content), path)
        with pytest.raises(DatasetError, match=message) as raised:
            RLDataset(path, tokenizer)
        assert "\n" not in str(raised.value)


def test_jsonl_and_parquet_give_the_same_prompts(tokenizer, gsm8k_parquet, tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in pq.read_table(gsm8k_parquet).to_pylist()))
    from_jsonl = RLDataset(jsonl, tokenizer, max_prompt_length=256)
    from_parquet = RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=256)
    assert from_jsonl.prompt_ids == from_parquet.prompt_ids and from_jsonl.rows == from_parquet.rows
    both = RLDataset([gsm8k_parquet, jsonl], tokenizer, max_prompt_length=256)
    assert len(both) == 2 * NUM_ROWS


def indices_of(batch) -> list[int]:
    return [info["index"] for info in batch.non_tensors["extra_info"]]


def test_loader_covers_each_epoch_and_shuffles_by_seed(tokenizer, gsm8k_parquet):
    dataset = RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=256)
    loader = PromptLoader(dataset, batch_size=5, seed=7)  # 12 rows: 2 full batches, 2 rows dropped
    assert len(loader) == 2
    epoch0 = [indices_of(b) for b in loader]
    epoch1 = [indices_of(b) for b in loader]
    assert [len(b) for b in epoch0] == [5, 5] and len(set(sum(epoch0, []))) == 10
    assert epoch0 != epoch1 and loader.state_dict() == {"epoch": 2, "index": 0}
    again = [indices_of(b) for b in PromptLoader(dataset, batch_size=5, seed=7)]
    assert again == epoch0
    assert [indices_of(b) for b in PromptLoader(dataset, batch_size=5, seed=8)] != epoch0
    in_order = PromptLoader(dataset, batch_size=5, shuffle=False, drop_last=False)
    assert [indices_of(b) for b in in_order] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]


def forever(loader: PromptLoader):
    """Batches across epochs, the way a trainer's step loop consumes them."""
    while True:
        yield from loader


def test_loader_resume_matches_continuing(tokenizer, gsm8k_parquet):
    dataset = RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=256)
    # 12 rows in batches of 4: 3 batches an epoch. Save mid-epoch, exactly at an epoch end, and in the second epoch.
    for consumed, expected_state in ((1, (0, 4)), (3, (1, 0)), (4, (1, 4))):
        loader = PromptLoader(dataset, batch_size=4, seed=3)
        stream = forever(loader)
        for _ in range(consumed):
            next(stream)
        state = loader.state_dict()
        assert (state["epoch"], state["index"]) == expected_state
        continued = [next(stream) for _ in range(4)]
        resumed_loader = PromptLoader(dataset, batch_size=4, seed=3)
        resumed_loader.load_state_dict(state)
        resumed_stream = forever(resumed_loader)
        resumed = [next(resumed_stream) for _ in range(4)]
        assert [indices_of(b) for b in resumed] == [indices_of(b) for b in continued]
        assert all(torch.equal(a.tensors["input_ids"], b.tensors["input_ids"]) for a, b in zip(resumed, continued))


def test_loader_refuses_bad_sizes_and_states(tokenizer, gsm8k_parquet):
    dataset = RLDataset(gsm8k_parquet, tokenizer, max_prompt_length=256)
    with pytest.raises(ValueError, match=r"data.train_batch_size=13 must be in \[1, 12\]"):
        PromptLoader(dataset, batch_size=13)
    with pytest.raises(ValueError, match="does not fit 2 batches of 5"):
        PromptLoader(dataset, batch_size=5).load_state_dict({"epoch": 0, "index": 10})


def test_a_row_with_images_is_refused_naming_it_and_the_key(tokenizer, gsm8k_parquet, tmp_path):
    """verl's image_key / video_key / audio_key: shardrl's models read text only, so images must not vanish."""
    rows = [row | {"images": None, "frames": None} for row in pq.read_table(gsm8k_parquet).to_pylist()]
    rows[3]["images"] = [{"bytes": b"\x89PNG"}]
    rows[5]["frames"] = ["clip.mp4"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mm.parquet")
    with pytest.raises(DatasetError, match=r"row 3: has 'images' \(data.image_key"):
        RLDataset(tmp_path / "mm.parquet", tokenizer)
    with pytest.raises(DatasetError, match="row 5: has 'frames'"):
        RLDataset(tmp_path / "mm.parquet", tokenizer, media_keys=("pictures", "frames"))
    for row in rows:
        row["images"] = []  # an empty column is no image
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "empty.parquet")
    assert len(RLDataset(tmp_path / "empty.parquet", tokenizer, media_keys=("pictures",))) == len(rows)
