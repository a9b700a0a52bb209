"""Pipeline plans (pure, no processes): hand-written orders, layer assignment, and invariants over a grid of sizes."""

from collections import Counter

import pytest

from shardrl.parallel.pipeline import chunk_pre_post, stage_layer_ids
from shardrl.parallel.schedules import (Action, ScheduleError, forward_only_order, interleaved_order,
                                        one_f_one_b_order, plan)


def _names(order: list[Action]) -> list[str]:
    return [f"{a.kind}{a.chunk}.{a.micro_batch}" for a in order]


def test_1f1b_order_hand_written():
    # PP=4, rank 1: two warm-up forwards, three F/B pairs, two drain backwards.
    assert _names(one_f_one_b_order(4, 1, 5)) == [
        "F0.0", "F0.1", "F0.2", "B0.0", "F0.3", "B0.1", "F0.4", "B0.2", "B0.3", "B0.4"]
    assert _names(one_f_one_b_order(4, 3, 2)) == ["F0.0", "B0.0", "F0.1", "B0.1"]
    # Fewer micro batches than stages: the warm-up is clipped.
    assert _names(one_f_one_b_order(4, 0, 2)) == ["F0.0", "F0.1", "B0.0", "B0.1"]


def test_interleaved_order_hand_written():
    # PP=2, VPP=2, 4 micro batches, rank 1: warm-up 2 = (PP-1-1)*2 + (VPP-1)*PP; groups of PP micro batches.
    assert _names(interleaved_order(2, 2, 1, 4)) == [
        "F0.0", "F0.1", "F1.0", "B1.0", "F1.1", "B1.1", "F0.2", "B0.0", "F0.3", "B0.1",
        "F1.2", "B1.2", "F1.3", "B1.3", "B0.2", "B0.3"]


def test_forward_only_order_hand_written():
    assert _names(forward_only_order(2, 2, 3)) == ["F0.0", "F0.1", "F1.0", "F1.1", "F0.2", "F1.2"]


def test_interleaved_needs_a_multiple_of_pp():
    with pytest.raises(ScheduleError, match="multiple of PP=4, got 6"):
        plan(4, 2, 6, forward_only=False)
    assert plan(4, 2, 6, forward_only=True)  # nothing waits on gradients: any count works


def test_stage_layer_ids_interleaved():
    owned = {(r, c): list(stage_layer_ids(8, 2, 2, r, c)) for r in range(2) for c in range(2)}
    assert owned == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    assert [chunk_pre_post(2, 2, r, c) for r, c in owned] == [(True, False), (False, False), (False, False),
                                                              (False, True)]


def test_stage_layer_ids_not_divisible():
    with pytest.raises(ScheduleError, match=r"num_hidden_layers=6 is not divisible by PP\*VPP = 2\*2"):
        stage_layer_ids(6, 2, 2, 0, 0)


SIZES = [(pp, vpp, m) for pp in (1, 2, 3, 4, 8) for vpp in (1, 2, 3) for m in (1, 2, 3, 4, 6, 8, 16, 24)
         if (vpp == 1 or (pp > 1 and m % pp == 0))]


@pytest.mark.parametrize("forward_only", [False, True])
def test_plans_are_complete_matched_and_bounded(forward_only):
    for pp, vpp, m in SIZES:
        steps = plan(pp, vpp, m, forward_only)
        # Every rank runs each chunk's forward (and backward) of every micro batch exactly once.
        kinds = "F" if forward_only else "FB"
        for rank_steps in steps:
            actions = Counter((s.action.kind, s.action.chunk, s.action.micro_batch) for s in rank_steps if s.action)
            assert actions == Counter({(k, c, b): 1 for k in kinds for c in range(vpp) for b in range(m)})
        # Every send has its receive at the same tick on the peer; nothing else is received.
        sent = Counter((s.tick, r, msg.peer, msg.kind, msg.chunk, msg.micro_batch)
                       for r, rank_steps in enumerate(steps) for s in rank_steps for msg in s.sends)
        got = Counter((s.tick, msg.peer, r, msg.kind, msg.chunk, msg.micro_batch)
                      for r, rank_steps in enumerate(steps) for s in rank_steps for msg in s.recvs)
        assert sent == got, (pp, vpp, m)
        # A message only ever goes to the ring neighbours, one per direction and tick.
        for r, rank_steps in enumerate(steps):
            for s in rank_steps:
                assert len(s.sends) <= 1 and len(s.recvs) <= 2
                assert all(msg.peer == (r + (1 if msg.kind == "F" else -1)) % pp for msg in s.sends)
        if not forward_only:
            _assert_activation_bound(steps, pp, vpp, m)


def _assert_activation_bound(steps, pp: int, vpp: int, m: int) -> None:
    for rank, rank_steps in enumerate(steps):
        held = peak = 0
        for s in rank_steps:
            if s.action:
                held += 1 if s.action.kind == "F" else -1
                peak = max(peak, held)
        bound = pp - rank if vpp == 1 else (pp - rank - 1) * 2 + (vpp - 1) * pp + 1
        assert peak == min(bound, m * vpp), (pp, vpp, m, rank)
