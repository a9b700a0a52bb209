"""CUDA-graph replay of decode steps (the GPU fast path; `ModelRunner` runs the same step functions eagerly
elsewhere, which is the reference).

A decode step of a small model is hundreds of tiny kernels; launched from Python their overhead, not the GPU, sets
the pace. Here a step over a padded batch of `rows` slots attending to `length` cache positions (the forward, the
sampling and the update of the next step's inputs) is captured once per key, on first use, and afterwards replayed
with one launch. The step reads and writes the runner's fixed device buffers; padding rows are free cache slots
(their k/v writes land in unused rows). All graphs share one memory pool. The graphs hold the addresses of the
weights, the cache and those buffers: replacing the weights or the cache (sleep/wake) needs a new `DecodeGraphs`;
copying new weights into the same tensors (`update_weights`) does not.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import Tensor

DecodeStep = Callable[[], Tensor | None]  # one captured step; its output (if any) stays valid until the next replay


def row_buckets(max_rows: int) -> list[int]:
    """Padded batch sizes with graphs: powers of two and 1.5x powers of two below `max_rows`, and `max_rows`.

    Few buckets keep capture cheap: graphs are captured again after every sleep (the cache they point to is freed),
    at most 1.5x the rows are computed.
    """
    candidates = {1 << i for i in range(max_rows.bit_length())} | {3 << i for i in range(max_rows.bit_length())}
    return sorted(b for b in candidates if b < max_rows) + [max_rows]


def length_bucket(length: int, max_len: int) -> int:
    """Cache positions attended to: the next power of two (at least 256), capped at the cache length."""
    return min(max_len, max(256, 1 << (length - 1).bit_length()))


class DecodeGraphs:
    """Graphs by key. `state` are the buffers a step advances (its inputs for the next step), put back after the
    eager warm-up run before each capture; `generator` is the one random stream captured steps may draw from (that of
    unseeded rows: a seeded row's uniform is a hash of buffers the step reads, no stream)."""

    def __init__(self, max_rows: int, state: list[Tensor], generator: torch.Generator) -> None:
        self.buckets = row_buckets(max_rows)
        self.state, self.generator = state, generator
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Tensor | None]] = {}
        self.pool = None

    def has(self, key: Hashable) -> bool:
        """Whether `key`'s graph is captured (its next `replay` does not capture)."""
        return key in self.graphs

    def rows_for(self, num_rows: int) -> int:
        """The padded row count a batch of `num_rows` runs with."""
        return next(b for b in self.buckets if b >= num_rows)

    def replay(self, key: Hashable, step: DecodeStep) -> Tensor | None:
        """Replay the graph of `key` (capturing `step` first when the key is new) -> the step's output."""
        if key not in self.graphs:
            self.graphs[key] = self._capture(step)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, step: DecodeStep) -> tuple[torch.cuda.CUDAGraph, Tensor | None]:
        # One eager run on a side stream first (lazy cuBLAS/allocator set-up must not happen inside the capture). It
        # writes the k/v the replay will write again; the inputs it advances are put back afterwards.
        saved = [t.clone() for t in self.state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        for tensor, value in zip(self.state, saved):
            tensor.copy_(value)
        graph = torch.cuda.CUDAGraph()
        # Each replay then draws fresh numbers: it advances the generator by what the captured kernels consumed.
        graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()
        return graph, out
