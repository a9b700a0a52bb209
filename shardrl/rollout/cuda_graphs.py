"""CUDA-graph replay of the decode forward (the GPU fast path; `ModelRunner.decode_hidden` is the portable reference).

A decode step of a small model is hundreds of tiny kernels; launched from Python their overhead, not the GPU, sets
the pace. Here the forward for a padded batch of `rows` slots attending to `length` cache positions is captured once
per (rows, length) bucket, on first use, and afterwards replayed with one launch. Inputs are copied into static
buffers first; the padding rows are free cache slots (their k/v writes land in unused rows). All graphs share one
memory pool. The graphs hold the addresses of the weights and of the cache: replacing either (sleep/wake) needs a
new `DecodeGraphs`; copying new weights into the same tensors (`update_weights`) does not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

DecodeForward = Callable[[Tensor, Tensor, int], Tensor]  # (ids [B], positions [B], length) -> hidden [B, H]


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
    def __init__(self, forward: DecodeForward, max_rows: int, max_len: int, device: torch.device) -> None:
        self.forward, self.max_len = forward, max_len
        self.buckets = row_buckets(max_rows)
        self.ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = None

    def run(self, ids: Tensor, positions: Tensor, length: int) -> Tensor:
        """ids, positions [B] on the device (B <= max_rows) -> hidden [B, H] of the last replay (valid until the
        next call)."""
        num_rows = ids.shape[0]
        rows = next(b for b in self.buckets if b >= num_rows)
        self.ids[:num_rows].copy_(ids)
        self.positions[:num_rows].copy_(positions)
        self.ids[num_rows:rows].zero_()
        self.positions[num_rows:rows].zero_()
        key = (rows, length_bucket(length, self.max_len))
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden[:num_rows]

    def _capture(self, rows: int, length: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        ids, positions = self.ids[:rows], self.positions[:rows]
        # One eager run on a side stream first (lazy cuBLAS/allocator set-up must not happen inside the capture).
        # It writes the same k/v the replay will write, so running it is harmless.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(ids, positions, length)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.forward(ids, positions, length)
        self.pool = graph.pool()
        return graph, hidden
