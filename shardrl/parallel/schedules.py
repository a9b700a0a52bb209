"""Pipeline schedules as pure plans: which forward/backward each stage runs, and which messages it exchanges, when.

No torch here, so the plans can be unit-tested (and printed) without processes.

A schedule is first written as an *order* per pipeline rank (the sequence of forwards ``F`` and backwards ``B`` that
rank runs, e.g. 1F1B). The orders are then played on a clock of unit ticks: at each tick every rank runs its next
action if its input has arrived (was produced at an earlier tick), and every message produced at tick ``t`` is
exchanged at the end of tick ``t`` by both ends. Because every rank derives the same plan, the sender and the
receiver of each message post matching operations in the same exchange, so the executor can never deadlock on
gloo or NCCL, and a rank knows which micro batch and chunk every incoming tensor belongs to.

Virtual stages: with ``PP`` ranks and ``VPP`` chunks per rank, virtual stage ``v = chunk * PP + pp_rank``; the model
runs virtual stages ``0 .. PP*VPP-1`` in order, so activations travel round the ring ``rank -> rank+1 (mod PP)``
and gradients the opposite way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal


class ScheduleError(ValueError):
    """A micro-batch count or stage layout the schedule cannot run; the message names the values."""


@dataclass(frozen=True)
class Action:
    """Run the forward (``"F"``) or backward (``"B"``) of `chunk` on micro batch `micro_batch`."""

    kind: Literal["F", "B"]
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class Message:
    """An activation (``kind="F"``, to the next virtual stage) or its gradient (``"B"``, to the previous one).

    `chunk` is the chunk *on the receiving rank* the tensor belongs to; `peer` is the other end's pipeline rank.
    """

    kind: Literal["F", "B"]
    chunk: int
    micro_batch: int
    peer: int


@dataclass
class Step:
    """One tick on one rank: run `action` (if any), then exchange `sends` and `recvs` with the neighbours."""

    tick: int
    action: Action | None = None
    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)


def one_f_one_b_order(pp_size: int, pp_rank: int, num_micro_batches: int) -> list[Action]:
    """1F1B: ``PP - rank - 1`` warm-up forwards (fewer if there are fewer micro batches), then alternate, then drain.

    A rank never holds more than ``PP - rank`` micro batches' activations.
    """
    num_warmup = min(pp_size - pp_rank - 1, num_micro_batches)
    order = [Action("F", 0, m) for m in range(num_warmup)]
    for m in range(num_micro_batches - num_warmup):
        order += [Action("F", 0, num_warmup + m), Action("B", 0, m)]
    order += [Action("B", 0, m) for m in range(num_micro_batches - num_warmup, num_micro_batches)]
    return order


def interleaved_order(pp_size: int, vpp_size: int, pp_rank: int, num_micro_batches: int) -> list[Action]:
    """Interleaved 1F1B: micro batches go through the chunks in groups of PP (forwards chunk 0 -> VPP-1, backwards
    VPP-1 -> 0), with a longer warm-up so every chunk of the group is primed before the first backward arrives.
    """
    if num_micro_batches % pp_size:
        raise ScheduleError(
            f"interleaved pipeline (VPP={vpp_size}) needs the number of micro batches to be a multiple of "
            f"PP={pp_size}, got {num_micro_batches}; change the micro batch size or the mini batch size"
        )
    group = pp_size * vpp_size
    total = num_micro_batches * vpp_size

    def nth(k: int, kind: Literal["F", "B"]) -> Action:
        chunk = (k % group) // pp_size
        micro_batch = (k // group) * pp_size + k % pp_size
        return Action(kind, chunk if kind == "F" else vpp_size - 1 - chunk, micro_batch)

    num_warmup = min((pp_size - pp_rank - 1) * 2 + (vpp_size - 1) * pp_size, total)
    order = [nth(k, "F") for k in range(num_warmup)]
    for k in range(total - num_warmup):
        order += [nth(num_warmup + k, "F"), nth(k, "B")]
    order += [nth(k, "B") for k in range(total - num_warmup, total)]
    return order


def forward_only_order(pp_size: int, vpp_size: int, num_micro_batches: int) -> list[Action]:
    """Forwards only, micro batches in groups of PP through the chunks (any count works: nothing waits on grads)."""
    return [
        Action("F", chunk, m)
        for start in range(0, num_micro_batches, pp_size)
        for chunk in range(vpp_size)
        for m in range(start, min(start + pp_size, num_micro_batches))
    ]


def rank_orders(pp_size: int, vpp_size: int, num_micro_batches: int, forward_only: bool) -> list[list[Action]]:
    """The action order of every pipeline rank for the schedule these sizes select."""
    if num_micro_batches < 1:
        raise ScheduleError(f"the pipeline needs at least one micro batch, got {num_micro_batches}")
    if forward_only:
        return [forward_only_order(pp_size, vpp_size, num_micro_batches)] * pp_size
    if vpp_size == 1:
        return [one_f_one_b_order(pp_size, r, num_micro_batches) for r in range(pp_size)]
    return [interleaved_order(pp_size, vpp_size, r, num_micro_batches) for r in range(pp_size)]


def play(orders: list[list[Action]], vpp_size: int) -> list[list[Step]]:
    """Play the per-rank `orders` on the tick clock; return each rank's steps (ticks where it does nothing dropped)."""
    pp_size = len(orders)
    last = pp_size * vpp_size - 1
    done_at: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, micro batch) -> tick it ran
    position = [0] * pp_size
    steps: list[list[Step]] = [[] for _ in range(pp_size)]
    tick = 0
    while any(position[r] < len(orders[r]) for r in range(pp_size)):
        ticks = [Step(tick) for _ in range(pp_size)]
        for rank in range(pp_size):
            if position[rank] == len(orders[rank]):
                continue
            action = orders[rank][position[rank]]
            stage = action.chunk * pp_size + rank
            # The input comes from the previous virtual stage (forward) or the next one (backward), or the loss.
            source = ("F", stage - 1) if action.kind == "F" else ("B", stage + 1)
            needs_message = (action.kind == "F" and stage > 0) or (action.kind == "B" and stage < last)
            if needs_message and done_at.get((*source, action.micro_batch), tick) >= tick:
                continue
            ticks[rank].action = action
            position[rank] += 1
        for rank, step in enumerate(ticks):
            if step.action is not None:
                _post(step.action, rank, pp_size, last, ticks)
                stage = step.action.chunk * pp_size + rank
                done_at[(step.action.kind, stage, step.action.micro_batch)] = tick
        if all(step.action is None for step in ticks):
            raise ScheduleError(f"pipeline schedule stalls at tick {tick} (positions {position}): orders are invalid")
        for rank, step in enumerate(ticks):
            if step.action or step.sends or step.recvs:
                steps[rank].append(step)
        tick += 1
    return steps


def _post(action: Action, rank: int, pp_size: int, last: int, ticks: list[Step]) -> None:
    """Add the message `action` produces (if any) to the sender's and the receiver's step of this tick."""
    stage = action.chunk * pp_size + rank
    if action.kind == "F" and stage < last:
        to_stage = stage + 1
    elif action.kind == "B" and stage > 0:
        to_stage = stage - 1
    else:
        return
    peer = to_stage % pp_size
    ticks[rank].sends.append(Message(action.kind, to_stage // pp_size, action.micro_batch, peer))
    ticks[peer].recvs.append(Message(action.kind, to_stage // pp_size, action.micro_batch, rank))


@functools.lru_cache(maxsize=32)  # every training step replays the same plan; callers must not modify it
def plan(pp_size: int, vpp_size: int, num_micro_batches: int, forward_only: bool) -> list[list[Step]]:
    """Every pipeline rank's steps for one forward(-backward) pass over `num_micro_batches` micro batches."""
    return play(rank_orders(pp_size, vpp_size, num_micro_batches, forward_only), vpp_size)
