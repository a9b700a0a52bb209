"""How one controller call becomes per-rank calls, and how their results become one value.

Pure functions over a role's `LayoutSpec` (no Ray), so the routing is tested on its own and read in one place:

* `ONE_TO_ALL`: every rank gets the same arguments; the result is the list of all ranks' results (rank order).
* `ALL_TO_ALL`: every positional and keyword argument is a list with one value per rank; results as above.
* `DP_COMPUTE`: every `Batch` argument is padded to a multiple of DP and cut into DP chunks; all ranks of one DP
  replica (its TP/CP/PP ranks) get that replica's chunk, other arguments go to everyone. Only the rank that owns the
  replica's output (last PP stage, TP rank 0, CP rank 0) sends a result back; `Batch` results are concatenated in DP
  order with the padding rows dropped, anything else comes back as a list with one entry per DP replica.
* `PER_REPLICA`: every positional and keyword argument is a list with one value per DP replica; all ranks of
  replica d get value d (a streaming rollout gives each engine replica its own new requests); the result is the
  list of each replica's output-owner result, in DP order.

A chunk that ends with padding rows says how many in `meta["num_pad"]`, so a worker that must not count them (a
loss normalised by sample count) can `unpad()`; a worker must return one output row per input row.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardrl.data.batch import NUM_PAD_KEY, Batch
from shardrl.parallel.layout_spec import LayoutSpec

DISPATCH_ATTR = "dispatch_mode"
DISPATCH_LAYOUT_ATTR = "dispatch_layout"


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_COMPUTE = "dp_compute"
    PER_REPLICA = "per_replica"


class DispatchError(ValueError):
    """Arguments or results that do not fit the dispatch mode; the message names the mode and the values."""


def dispatch_mode(mode: Dispatch, layout: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare how the controller calls a worker method (read by `RoleHandle.call` / `submit`).

    `layout` names one of the role's extra layouts (`Role.extra_layouts`) to split DP_COMPUTE batches by, for a
    worker that hosts parts laid out differently (the hybrid engine's rollout next to its actor). The method
    itself is unchanged, so it stays a plain method for tests without Ray.
    """

    def mark(method: Callable[..., Any]) -> Callable[..., Any]:
        setattr(method, DISPATCH_ATTR, mode)
        setattr(method, DISPATCH_LAYOUT_ATTR, layout)
        return method

    return mark


@dataclass
class Routing:
    """Distinct payloads `(args, kwargs)`, which payload each rank gets, which ranks report results, and how to
    turn the reported results (by rank) into the call's value."""

    payloads: list[tuple[tuple, dict[str, Any]]]
    payload_of_rank: list[int]
    reporting_ranks: list[int]
    collect: Callable[[dict[int, Any]], Any]


def output_owner(spec: LayoutSpec, rank: int) -> bool:
    """The one rank per DP replica whose output is the replica's result."""
    coords = spec.coords(rank)
    return coords["pp"] == spec.pp - 1 and coords["tp"] == 0 and coords["cp"] == 0


def route(mode: Dispatch, spec: LayoutSpec, args: tuple, kwargs: dict[str, Any]) -> Routing:
    world = spec.world_size
    if mode is Dispatch.ONE_TO_ALL:
        return Routing([(args, kwargs)], [0] * world, list(range(world)), _in_rank_order)
    if mode is Dispatch.ALL_TO_ALL:
        return _plan_all_to_all(world, args, kwargs)
    if mode is Dispatch.DP_COMPUTE:
        return _plan_dp_compute(spec, args, kwargs)
    if mode is Dispatch.PER_REPLICA:
        return _plan_per_replica(spec, args, kwargs)
    raise DispatchError(f"unknown dispatch mode {mode!r}; use one of {[m.name for m in Dispatch]}")


def _in_rank_order(by_rank: dict[int, Any]) -> list[Any]:
    return [by_rank[r] for r in sorted(by_rank)]


def _per_target_payloads(mode: str, target: str, count: int, args: tuple,
                         kwargs: dict[str, Any]) -> list[tuple[tuple, dict[str, Any]]]:
    """Payload i holds value i of every argument; each argument must be a list of `count` values."""
    named = {f"argument {i}": a for i, a in enumerate(args)} | {f"keyword {k!r}": v for k, v in kwargs.items()}
    for name, value in named.items():
        if not isinstance(value, Sequence) or len(value) != count:
            length = len(value) if isinstance(value, Sequence) else type(value).__name__
            raise DispatchError(f"{mode}: {name} must be a list with one value per {target} ({count}), got {length}")
    return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}) for i in range(count)]


def _plan_all_to_all(world: int, args: tuple, kwargs: dict[str, Any]) -> Routing:
    payloads = _per_target_payloads("ALL_TO_ALL", "rank", world, args, kwargs)
    return Routing(payloads, list(range(world)), list(range(world)), _in_rank_order)


def _plan_per_replica(spec: LayoutSpec, args: tuple, kwargs: dict[str, Any]) -> Routing:
    payloads = _per_target_payloads("PER_REPLICA", "DP replica", spec.dp, args, kwargs)
    dp_of_rank = [spec.coords(r)["dp"] for r in range(spec.world_size)]
    owners = sorted((r for r in range(spec.world_size) if output_owner(spec, r)), key=lambda r: dp_of_rank[r])
    return Routing(payloads, dp_of_rank, owners, lambda by_rank: [by_rank[r] for r in owners])


def _split_for_dp(value: Any, num_chunks: int) -> list[Any]:
    """A Batch padded and cut into `num_chunks` (each chunk's meta["num_pad"] counts the padding rows it ends
    with); any other value repeated for every chunk."""
    if not isinstance(value, Batch):
        return [value] * num_chunks
    if NUM_PAD_KEY in value.meta:
        raise DispatchError(f"DP_COMPUTE pads batches itself; got one with meta[{NUM_PAD_KEY!r}] set, unpad() it first")
    chunks = value.chunk(num_chunks, pad=True)
    size = len(chunks[0])
    for i, chunk in enumerate(chunks):
        num_pad = min(size, max(0, (i + 1) * size - len(value)))
        chunk.meta.pop(NUM_PAD_KEY, None)
        if num_pad:
            chunk.meta[NUM_PAD_KEY] = num_pad
    return chunks


def _plan_dp_compute(spec: LayoutSpec, args: tuple, kwargs: dict[str, Any]) -> Routing:
    lengths = {len(a) for a in (*args, *kwargs.values()) if isinstance(a, Batch)}
    if len(lengths) != 1:
        raise DispatchError(
            f"DP_COMPUTE needs Batch arguments of one length to split over data-parallel ranks, got lengths {lengths}"
        )
    num_rows = lengths.pop()
    split_args = [_split_for_dp(a, spec.dp) for a in args]
    split_kwargs = {k: _split_for_dp(v, spec.dp) for k, v in kwargs.items()}
    payloads = [
        (tuple(a[dp] for a in split_args), {k: v[dp] for k, v in split_kwargs.items()}) for dp in range(spec.dp)
    ]
    chunk_rows = -(-num_rows // spec.dp)
    dp_of_rank = [spec.coords(r)["dp"] for r in range(spec.world_size)]
    owners = sorted((r for r in range(spec.world_size) if output_owner(spec, r)), key=lambda r: dp_of_rank[r])

    def collect(by_rank: dict[int, Any]) -> Any:
        outputs = [by_rank[r] for r in owners]
        if not all(isinstance(o, Batch) for o in outputs):
            return outputs
        for rank, out in zip(owners, outputs):
            if len(out) != chunk_rows:
                raise DispatchError(
                    f"DP_COMPUTE: rank {rank} returned {len(out)} rows for a chunk of {chunk_rows}; "
                    "return one row per input row (padding included)"
                )
            out.meta.pop(NUM_PAD_KEY, None)
        return Batch.concat(outputs).take(range(num_rows))

    return Routing(payloads, dp_of_rank, owners, collect)
