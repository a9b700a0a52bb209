"""Batch container: every operation against hand-written expected rows, and the refusal cases."""

import numpy as np
import pytest
import torch

from shardrl.data.batch import Batch, BatchError


def make(n: int = 4, offset: int = 0, meta: dict | None = None) -> Batch:
    """Row r holds r + offset in every column, so any reordering is visible in all of them."""
    rows = torch.arange(offset, offset + n)
    return Batch(
        {"ids": torch.stack([rows * 10, rows * 10 + 1], dim=1), "score": rows.float()},
        {
            "uid": [f"u{r}" for r in rows.tolist()],
            "msgs": [[{"role": "user", "content": str(r)}] for r in rows.tolist()],
        },
        meta if meta is not None else {"temperature": 1.0},
    )


def rows_of(batch: Batch) -> list[int]:
    """The row ids of each column, checked to agree, so a test sees one list."""
    from_score = batch.tensors["score"].long().tolist()
    assert batch.tensors["ids"][:, 0].tolist() == [r * 10 for r in from_score]
    assert list(batch.non_tensors["uid"]) == [f"u{r}" for r in from_score]
    assert [m[0]["content"] for m in batch.non_tensors["msgs"]] == [str(r) for r in from_score]
    return from_score


def test_construction_keeps_list_columns_one_dimensional():
    batch = Batch(non_tensors={"tokens": [[1, 2], [3, 4], [5, 6]]})
    assert len(batch) == 3
    assert batch.non_tensors["tokens"].shape == (3,) and batch.non_tensors["tokens"][1] == [3, 4]


def test_construction_refuses_mismatched_lengths():
    with pytest.raises(BatchError, match=r"tensors\['a'\].*3.*non_tensors\['b'\].*2"):
        Batch({"a": torch.zeros(3)}, {"b": ["x", "y"]})


def test_take_reorders_every_column():
    assert rows_of(make().take([3, 0, 0, 2])) == [3, 0, 0, 2]
    with pytest.raises(BatchError, match=r"\[0, 4\)"):
        make().take([0, 4])


def test_take_copies_meta():
    batch = make()
    taken = batch.take([0])
    taken.meta["temperature"] = 0.5
    assert batch.meta["temperature"] == 1.0


def test_select_keeps_named_columns():
    out = make().select(["score"], ["uid"])
    assert list(out.tensors.keys()) == ["score"] and list(out.non_tensors) == ["uid"]
    assert len(out) == 4 and out.meta == {"temperature": 1.0}
    only_non_tensors = make().select([], ["uid"])
    assert len(only_non_tensors) == 4 and list(only_non_tensors.tensors.keys()) == []
    with pytest.raises(BatchError, match="has no keys \\['nope'\\]"):
        make().select(["nope"])


def test_union_merges_and_accepts_equal_overlap():
    left = make().select(["ids"], ["uid"])
    right = Batch({"ids": make().tensors["ids"], "adv": torch.ones(4)}, {"uid": make().non_tensors["uid"]}, {"step": 3})
    out = left.union(right)
    assert sorted(out.tensors.keys()) == ["adv", "ids"] and out.meta == {"temperature": 1.0, "step": 3}
    assert torch.equal(out.tensors["ids"], make().tensors["ids"])


@pytest.mark.parametrize(
    "other, message",
    [
        (Batch({"score": torch.zeros(4)}), "tensor 'score' differs"),
        (Batch(non_tensors={"uid": ["a", "b", "c", "d"]}), "non-tensor column 'uid' differs"),
        (Batch({"x": torch.zeros(4)}, meta={"temperature": 0.7}), "meta 'temperature' differs: 1.0 vs 0.7"),
        (Batch({"x": torch.zeros(3)}), "4 and 3 rows"),
    ],
)
def test_union_refuses_conflicts(other, message):
    with pytest.raises(BatchError, match=message):
        make().union(other)


def test_split_by_sizes():
    parts = make(5).split([2, 0, 3])
    assert [rows_of(p) for p in parts] == [[0, 1], [], [2, 3, 4]]
    with pytest.raises(BatchError, match="sum to 5"):
        make(5).split([2, 2])


def test_chunk_even_and_refused_uneven():
    assert [rows_of(c) for c in make(6).chunk(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(BatchError, match="5 rows do not split evenly into 2 chunks; pass pad=True"):
        make(5).chunk(2)


def test_chunk_with_padding_then_concat_unpad_round_trip():
    chunks = make(5).chunk(3, pad=True)
    # 5 rows padded to 6 with a copy of row 0.
    assert [rows_of(c) for c in chunks] == [[0, 1], [2, 3], [4, 0]]
    assert all(c.meta["num_pad"] == 1 for c in chunks)
    restored = Batch.concat(chunks).unpad()
    assert rows_of(restored) == [0, 1, 2, 3, 4] and "num_pad" not in restored.meta


def test_pad_to_divisor_wraps_around_and_counts():
    padded = make(3).pad_to_divisor(8)
    assert rows_of(padded) == [0, 1, 2, 0, 1, 2, 0, 1] and padded.meta["num_pad"] == 5
    assert make(4).pad_to_divisor(2).meta["num_pad"] == 0
    assert rows_of(padded.unpad()) == [0, 1, 2]


def test_concat_appends_metrics_and_refuses_conflicts():
    a = make(2, meta={"metrics": {"loss": [1.0]}, "temperature": 1.0})
    b = make(3, offset=2, meta={"metrics": {"loss": [2.0], "kl": [0.1]}, "temperature": 1.0})
    out = Batch.concat([a, b])
    assert rows_of(out) == [0, 1, 2, 3, 4]
    assert out.meta == {"metrics": {"loss": [1.0, 2.0], "kl": [0.1]}, "temperature": 1.0}
    assert a.meta["metrics"] == {"loss": [1.0]}  # inputs untouched
    with pytest.raises(BatchError, match="meta 'temperature' differs between batches: 1.0 vs 0.5"):
        Batch.concat([a, make(1, meta={"temperature": 0.5})])
    with pytest.raises(BatchError, match="column keys differ"):
        Batch.concat([a, a.select(["ids"])])


def test_repeat_interleaved_and_tiled():
    assert rows_of(make(3).repeat(2)) == [0, 0, 1, 1, 2, 2]
    assert rows_of(make(3).repeat(2, interleave=False)) == [0, 1, 2, 0, 1, 2]


def test_to_device_keeps_values():
    moved = make().to("cpu")
    assert torch.equal(moved.tensors["ids"], make().tensors["ids"]) and rows_of(moved) == [0, 1, 2, 3]


def test_pickle_round_trip_for_ray():
    import pickle

    out = pickle.loads(pickle.dumps(make()))
    assert rows_of(out) == [0, 1, 2, 3] and isinstance(out.non_tensors["uid"], np.ndarray)
