"""Colocated weight sync: the actor's full HF tensors streamed into the rollout engine of the same process.

Each tensor is gathered from the actor's shards (TP/ETP/EP/PP, collective over the actor layout), handed to the
engine, which keeps only its own rollout-TP slice, and dropped: peak extra memory is one full tensor.
"""

from __future__ import annotations

import time

from shardrl.models.hf_bridge import export_hf_weights
from shardrl.rollout.engine import Engine
from shardrl.workers.engine import ModelEngine


def sync_colocated(actor: ModelEngine, rollout: Engine, version: int | None, weight_sync) -> dict[str, float]:
    start, num_bytes = time.perf_counter(), 0

    def stream():
        nonlocal num_bytes
        for name, tensor in export_hf_weights(actor.chunks, actor.layout):
            num_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    rollout.update_weights(stream(), version)
    seconds = time.perf_counter() - start
    return {"sync/bytes": float(num_bytes), "sync/seconds": seconds, "sync/gbps": num_bytes / max(seconds, 1e-9) / 1e9}
