"""RolloutWorker.stream's admission rule on a real single-process engine: streamed requests enter the engine in
refill chunks (1/8 of its slots) instead of one prefill step per finished sequence, and none is lost, duplicated or
changed by waiting in the backlog (greedy outputs equal those of the same requests submitted all at once)."""

from collections import deque

import pytest

from shardrl.data import builtin_task
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine
from shardrl.rollout.request import SamplingParams
from shardrl.rollout.runner import EngineConfig
from shardrl.workers.stream import REFILL_CHUNK, admit

SLOTS = 16
CHUNK = SLOTS // REFILL_CHUNK  # 2
# 16 requests fill the engine; short ones finish one by one, so slots free up one at a time
LENGTHS = [2, 3, 4, 5, 6, 7] + [12] * 10 + [3] * 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return builtin_task.prepare(tmp_path_factory.mktemp("task"))["model"]


def requests():
    return [([5 + i % 7, 9, 11], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for i, n in enumerate(LENGTHS)]


def engine(model_path: str) -> Engine:
    return Engine.from_pretrained(model_path, Layout.single(), EngineConfig(max_num_seqs=SLOTS, max_model_len=64,
                                                                            max_num_batched_tokens=1024))


def test_admission_in_refill_chunks_loses_and_changes_nothing(model_path):
    e = engine(model_path)
    backlog = deque((ids, params, f"row {i}") for i, (ids, params) in enumerate(requests()))
    rows: dict[str, str] = {}
    outputs, prefill_sizes = {}, []
    admitted = 0  # since the last prefill: a step already launched ahead is recorded before the prefill runs
    while backlog or e.has_unfinished():
        before = (len(backlog), e.stats.prefill_steps)
        admit(e, backlog, rows)
        admitted += before[0] - len(backlog)
        assert len(e.scheduler.running) + len(e.scheduler.waiting) <= SLOTS  # the scheduler's own view
        assert e.free_capacity() == SLOTS - len(e.scheduler.running) - len(e.scheduler.waiting)
        for out in e.step():
            assert out.request_id not in outputs
            outputs[out.request_id] = out
        if e.stats.prefill_steps > before[1]:
            prefill_sizes.append(admitted)
            assert admitted >= CHUNK or not backlog  # a chunk, or the whole rest of the backlog
            admitted = 0
    assert prefill_sizes[0] == SLOTS and sum(prefill_sizes) == len(LENGTHS)
    assert sorted(rows.values()) == sorted(f"row {i}" for i in range(len(LENGTHS)))

    reference = engine(model_path)  # the engine's own scheduler, every request submitted at once
    expected = reference.generate([ids for ids, _ in requests()], [p for _, p in requests()])
    assert reference.stats.prefill_steps >= len(prefill_sizes)  # it refills as slots free, chunks take no more
    got = [outputs[rid] for rid, _ in sorted(rows.items(), key=lambda kv: int(kv[1].split()[1]))]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [len(o.token_ids) for o in got] == LENGTHS
