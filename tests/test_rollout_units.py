"""Rollout building blocks: decode attention against a per-head loop, cache hooks, scheduler decisions, buckets."""

import math

import pytest
import torch
from torch.testing import assert_close

from shardrl.rollout.cuda_graphs import length_bucket, row_buckets
from shardrl.rollout.kv_cache import (
    DecodeAttention,
    KVCache,
    KVCacheError,
    num_slots_for_budget,
    reference_decode_attention,
)
from shardrl.rollout.request import Request, SamplingParams
from shardrl.rollout.scheduler import Scheduler


def test_decode_attention_matches_per_head_loop():
    torch.manual_seed(0)
    num_rows, num_heads, num_kv, length, dim = 3, 6, 2, 7, 4
    q = torch.randn(num_rows, num_heads, dim)
    keys, values = torch.randn(num_rows, num_kv, length, dim), torch.randn(num_rows, num_kv, length, dim)
    positions = torch.tensor([6, 0, 3])
    valid = torch.arange(length) <= positions.unsqueeze(1)
    out = reference_decode_attention(q, keys, values, valid, scale=0.5)
    for b in range(num_rows):
        n = positions[b] + 1
        for h in range(num_heads):
            kv = h // (num_heads // num_kv)  # query heads 0-2 read KV head 0, 3-5 KV head 1
            weights = torch.softmax(keys[b, kv, :n] @ q[b, h] * 0.5, dim=0)
            assert_close(out[b, h], weights @ values[b, kv, :n], atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows, num_heads, num_kv, dim", [
    (64, 14, 2, 64),  # Qwen2-0.5B's heads; 64 rows x 2 KV heads: each row's tokens split over several programs
    (300, 8, 8, 64),  # no grouping; enough rows for one program per (row, KV head)
    (5, 16, 4, 128),  # few rows, head_dim 128: many splits, most of them empty for the short rows
    (6, 4, 2, 8),  # a tiny test model's head_dim, below the 16 a tensor-core dot needs (padded)
])
def test_split_kv_decode_attention_reads_only_each_rows_tokens(num_rows, num_heads, num_kv, dim):
    """Rows of very different lengths in one batch, the cache holding more slots than rows and garbage (NaN) past
    each row's length: the split-KV kernel in bf16 matches the fp32 reference, so it reads exactly positions
    0..p[b], and its split results merge into the softmax over the whole row."""
    from shardrl.rollout.decode_attention import WAVES, num_splits_for, split_kv_decode_attention

    torch.manual_seed(1)
    slots, max_len = num_rows + 6, 512
    q = torch.randn(num_rows, num_heads, dim, device="cuda").bfloat16()
    keys = torch.randn(slots, max_len, num_kv, dim, device="cuda").bfloat16()
    values = torch.randn(slots, max_len, num_kv, dim, device="cuda").bfloat16()
    positions = torch.randint(0, max_len, (num_rows,), device="cuda")
    positions[:4] = torch.tensor([0, 1, max_len - 1, 7])[:num_rows]
    past = torch.arange(max_len, device="cuda") > positions.unsqueeze(1)  # [B, L]
    keys[:num_rows][past], values[:num_rows][past] = float("nan"), float("nan")
    got = split_kv_decode_attention(q, keys, values, (positions + 1).to(torch.int32), max_len, scale=0.125)
    rows_k = keys[:num_rows].float().nan_to_num().transpose(1, 2)  # [B, nkv, L, D]
    rows_v = values[:num_rows].float().nan_to_num().transpose(1, 2)
    expected = reference_decode_attention(q.float(), rows_k, rows_v, ~past, scale=0.125)
    assert got.dtype == torch.bfloat16 and got.shape == (num_rows, num_heads, dim)
    assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)  # bf16 probabilities and output
    programs = num_rows * num_kv  # without splits; fewer than WAVES per SM means the row's tokens are split
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    assert (num_splits_for(num_rows, num_kv, max_len, q.device) > 1) == (programs < WAVES * sms)


def test_decode_hook_writes_the_new_token_and_attends_to_its_prefix():
    cache = KVCache(num_layers=2, num_slots=3, max_len=8, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device=torch.device("cpu"))
    keys, values = cache.layer(1)  # [slots, positions, kv heads, D]
    keys[0, :2, 0] = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    values[0, :2, 0] = torch.tensor([[10.0, 0.0], [0.0, 10.0]])
    hook = DecodeAttention(cache, positions=torch.tensor([2, 0]), length=4)
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]]])  # [B=2, heads=1, D=2]
    k_new, v_new = torch.tensor([[[0.0, 0.0]], [[5.0, 5.0]]]), torch.tensor([[[4.0, 4.0]], [[7.0, 8.0]]])
    out = hook.attend(1, q, k_new, v_new, seqs=None, scale=1.0)
    assert torch.equal(keys[1, 0, 0], torch.tensor([5.0, 5.0]))
    assert torch.equal(values[0, 2, 0], torch.tensor([4.0, 4.0]))
    # slot 0 attends to positions 0..2 with scores (1, 0, 0); slot 1 only to its own new token
    w = torch.tensor([math.e, 1.0, 1.0]) / (math.e + 2)
    expected0 = w @ torch.tensor([[10.0, 0.0], [0.0, 10.0], [4.0, 4.0]])
    assert_close(out[0, 0], expected0)
    assert_close(out[1, 0], torch.tensor([7.0, 8.0]))
    assert torch.equal(cache.layer(0)[0], torch.zeros(3, 8, 1, 2))  # other layers untouched


def _request(rid, num_prompt, max_tokens=4):
    return Request(rid, list(range(num_prompt)), SamplingParams(max_tokens=max_tokens), frozenset(), max_len=64)


def test_scheduler_prefill_budget_slots_and_decode_rows():
    scheduler = Scheduler(num_slots=3, max_num_seqs=4, max_num_batched_tokens=10)
    for rid, n in (("a", 4), ("b", 5), ("c", 2), ("d", 3)):
        scheduler.add(_request(rid, n))
    first = scheduler.schedule()
    assert first.kind == "prefill" and [r.request_id for r in first.requests] == ["a", "b"]  # 4+5 <= 10 < 4+5+2
    second = scheduler.schedule()
    assert [r.request_id for r in second.requests] == ["c"] and second.requests[0].slot == 2  # 3 slots: d waits
    scheduler.release(first.requests[0])  # "a" finishes: slot 0 frees, "d" takes it
    third = scheduler.schedule()
    assert [(r.request_id, r.slot) for r in third.requests] == [("d", 0)]
    decode = scheduler.schedule()
    assert decode.kind == "decode" and decode.num_rows == 3
    assert [r.request_id for r in decode.requests] == ["d", "b", "c"]
    scheduler.release(decode.requests[2])
    assert scheduler.schedule().num_rows == 2
    taken = scheduler.remove({"b"})
    assert [r.request_id for r in taken] == ["b"] and taken[0].slot is None
    assert scheduler.schedule().num_rows == 1


def test_scheduler_refuses_a_prompt_over_the_token_budget():
    with pytest.raises(ValueError, match="max_num_batched_tokens=10"):
        Scheduler(num_slots=2, max_num_seqs=2, max_num_batched_tokens=10).add(_request("x", 11))


def test_request_finish_reasons():
    request = Request("r", [1, 2], SamplingParams(max_tokens=3), frozenset({9}), max_len=64)
    request.append(5, -1.0, None, 0)
    assert request.finish_reason is None
    request.append(9, -1.0, None, 0)
    assert request.finish_reason == "stop"
    capped = Request("r", [1, 2], SamplingParams(max_tokens=10), frozenset(), max_len=4)
    capped.append(5, -1.0, None, 0)
    capped.append(6, -1.0, None, 0)
    assert capped.finish_reason == "length" and capped.num_tokens == 4


def test_cache_budget_and_buckets():
    assert num_slots_for_budget(10_000, 3_000, max_num_seqs=8, source="x") == 3
    assert num_slots_for_budget(10_000, 1_000, max_num_seqs=8, source="x") == 8
    with pytest.raises(KVCacheError, match="gpu_memory_utilization"):
        num_slots_for_budget(100, 3_000, max_num_seqs=8, source="gpu_memory_utilization")
    assert row_buckets(40) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40]
    assert row_buckets(3) == [1, 2, 3]
    assert [length_bucket(n, 600) for n in (1, 256, 257, 513)] == [256, 256, 512, 600]
