"""Start or join the Ray cluster the controller places its workers on.

Without an address we start a private local instance (`address="local"`): plain `ray.init()` would attach to any
cluster recorded in /tmp/ray, e.g. another user's job on the same machine. The local instance has no dashboard (it
would listen on a port for anyone on the network), no usage reporting, and a small object store so it starts on a
laptop or a CI runner; batches between controller and workers are far smaller than that.
"""

from __future__ import annotations

import logging
import os

import ray

DEFAULT_OBJECT_STORE_BYTES = 1 << 30


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES,
) -> None:
    """Connect to the cluster at `address`, or start a local one with `num_cpus` (None: all cores).

    A second call while Ray is running keeps the running instance, so tests and nested entry points share one.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    if address is not None:
        ray.init(address=address, **quiet)
        return
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=object_store_bytes,
        **quiet,
    )
